"""A program serves only the calls whose situation matches what its trace read, also where that state
lives outside the model's instance attributes (issue 13's promise, found wanting by hostile probes).

- Class attributes read through an instance (``self.use_extra`` with ``use_extra = False`` on the
  class): set on the instance, changed on the class, shadowed by a subclass.
- Attributes the trace found absent: ``getattr(self, "more", 0)``, ``hasattr(self, "tail")``, then
  set; and an attribute set while traced, then deleted.
- A method patched on the class (``nn.Linear.forward``, a model class's ``forward``).
- Python attributes a data pipeline sets on input tensors (``getattr(x, "packed", False)``).
- A copy or a saved program made after such a value changed keeps the traced value.
- What the methods, properties and class methods of a global settings object read on ``self``.
- torch's process-wide settings read through getters (``torch.get_num_threads()``, the matmul
  precision, ``dist.is_initialized()``) and as flags of ``torch.backends``.
- Hugging Face: ``GradientCheckpointingLayer.gradient_checkpointing`` (a class default) set on one
  layer of a stack whose layers are billed as copies of the first; ``loss_function`` replaced.

Each change in both directions, every call compared with FlopCounterMode on the same call.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import functools
import io
import math
import os
import pickle
import sys
import threading
import types
import warnings
from os import getenv

import pytest
import torch
import torch.backends.cuda as cuda_backend
from torch import get_float32_matmul_precision as float32_matmul_precision
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

import fxflops
from reference import assert_counted_call, flop_counter_call


class Knobs(nn.Module):
    use_extra = False  # a class default the forward reads through the instance

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if self.use_extra:
            h = self.extra(h)
        for _ in range(getattr(self, "more", 0)):
            h = self.extra(h)
        if hasattr(self, "tail"):
            h = self.tail(h)
        return h


def _check(wrapper, model, backward: bool, label: str) -> None:
    assert_counted_call(wrapper, model, (torch.randn(5, 8),), backward, label)


def _counted_then_rewound(wrapper, model, x, backward: bool, rewind, label: object) -> None:
    """One call of ``wrapper`` counted; then ``rewind()`` puts back what the call moved (a counter
    the model increments), so that FlopCounterMode's call of ``model`` sees what it saw."""
    wrapper.flops.reset()
    out = wrapper(x)
    if backward:
        out.sum().backward()
    rewind()
    assert wrapper.flops.uncounted == 0, label
    assert wrapper.flops.total() == flop_counter_call(model, (x,), {}, backward=backward), label


def _counted_in_another_thread(wrapper, model, x, backward: bool, setup=lambda: None) -> tuple[int, int]:
    """(fxflops' count, FlopCounterMode's) of one call made in a new thread, after ``setup()`` there."""
    results = []

    def other_thread() -> None:
        setup()
        wrapper.flops.reset()
        out = wrapper(x)
        if backward:
            out.sum().backward()
        results.append((wrapper.flops.total(), flop_counter_call(model, (x,), {}, backward=backward)))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=60)
    (counts,) = results
    return counts


class _Shadow(Knobs):
    pass


@pytest.mark.parametrize("backward", [False, True])
def test_class_and_absent_attributes_guard_their_programs(backward):
    model = Knobs()
    wrapper = fxflops.instrument(model, backward=backward)
    steps = [
        ("traced", lambda: None),
        ("set on the instance over the class default", lambda: setattr(model, "use_extra", True)),
        ("instance attribute deleted: the class default again", lambda: delattr(model, "use_extra")),
        ("changed on the class", lambda: setattr(Knobs, "use_extra", True)),
        ("class back", lambda: setattr(Knobs, "use_extra", False)),
        ("getattr default replaced", lambda: setattr(model, "more", 2)),
        ("getattr default again", lambda: delattr(model, "more")),
        ("hasattr becomes true (a plain attribute)", lambda: object.__setattr__(model, "tail", torch.relu)),
        ("hasattr false again", lambda: object.__delattr__(model, "tail")),
        ("a subclass shadows the class default", lambda: setattr(model, "__class__", _Shadow) or setattr(_Shadow, "use_extra", True)),
    ]
    try:
        for label, change in steps:
            change()
            _check(wrapper, model, backward, label)
    finally:
        Knobs.use_extra = False
        if "use_extra" in vars(_Shadow):
            del _Shadow.use_extra


def test_a_forward_patched_on_the_class_gets_its_own_program():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    wrapper = fxflops.instrument(model)
    _check(wrapper, model, False, "traced")
    original = nn.Linear.forward
    weight = torch.randn(8, 8)

    def with_adapter(self, x):  # a library patching the class (a LoRA-style extra product)
        return original(self, x @ weight[: x.shape[-1], : x.shape[-1]])

    try:
        nn.Linear.forward = with_adapter
        _check(wrapper, model, False, "nn.Linear.forward patched")
    finally:
        nn.Linear.forward = original
    _check(wrapper, model, False, "restored")


def _tiny_llama(layers: int, attn: str) -> torch.nn.Module:
    """A Hugging Face Llama of ``layers`` layers and ``attn`` attention, random weights (seed 0)."""
    import transformers  # a test dependency (``.[test]``): a missing one fails, never skips

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(config)


def test_hf_layer_checkpointing_class_default_and_loss_function():
    model = _tiny_llama(3, "eager").train()
    wrapper = fxflops.instrument(model, backward=True)

    def check(label):
        ids = torch.randint(0, 128, (2, 9))
        wrapper.flops.reset()
        wrapper(input_ids=ids, labels=ids).loss.backward()
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        assert wrapper.flops.uncounted == 0, label
        assert wrapper.flops.hardware_flops() == counter.get_total_flops(), label

    check("traced")
    layer = model.model.layers[1]  # billed as a copy of layers[0] in the capture
    layer.gradient_checkpointing = True  # over the class default False
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    check("one layer checkpointed")
    del layer.gradient_checkpointing
    check("class default again")
    projection = torch.randn(128, 64) * 0.01
    default_loss = model.loss_function

    def loss_with_projection(logits, labels, vocab_size, **kwargs):  # an auxiliary term with a matmul
        return default_loss(logits, labels, vocab_size, **kwargs) + (logits.float() @ projection).pow(2).mean()

    model.loss_function = loss_with_projection
    check("loss_function replaced")


REPEATS = 1  # a module-level setting the model's code reads


def _scaled(h, extra):  # a helper the forward calls: a library may patch it in
    return h


class Globals(nn.Module):
    def __init__(self, factor: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

        def times(h):  # a closure over the constructor's argument
            for _ in range(factor):
                h = self.fc(h)
            return h

        self.times = times

    def forward(self, x):
        global _CALLS
        _CALLS += 1  # the code's own bookkeeping: not a situation
        for _ in range(REPEATS):
            x = self.fc(x)
        return _scaled(self.times(x), self.fc)


_CALLS = 0


def test_globals_and_helpers_the_code_reads_guard_their_programs():
    global REPEATS, _scaled
    model = Globals(1)
    wrapper = fxflops.instrument(model)
    original = _scaled
    try:
        _check(wrapper, model, False, "traced")
        REPEATS = 3
        _check(wrapper, model, False, "a global setting changed")
        _scaled = lambda h, fc: fc(h)  # noqa: E731 - a helper patched in, as fused kernels are
        _check(wrapper, model, False, "a helper function patched")
        REPEATS, _scaled = 1, original
        _check(wrapper, model, False, "both back")
        captures = wrapper.captures
        _check(wrapper, model, False, "again: the bookkeeping global changed, no new program")
        assert wrapper.captures == captures
    finally:
        REPEATS, _scaled = 1, original


def test_a_replaced_closure_and_held_contents_guard_their_programs():
    model = Globals(1)
    wrapper = fxflops.instrument(model)
    _check(wrapper, model, False, "traced")
    model.times = _closure_over(model, 3)
    _check(wrapper, model, False, "the closure replaced by one over another value")


def _closure_over(model, factor):
    def times(h):
        for _ in range(factor):
            h = model.fc(h)
        return h

    return times


class Held(nn.Module):
    """Settings held in objects whose reads cannot be recorded one by one, and a tensor read by value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.namespace = types.SimpleNamespace(n=1)  # a class defined in C
        self.scale = functools.partial(_repeat_rows, times=1)  # its keyword decides the rows
        self.reps = torch.tensor(1)  # a plain tensor attribute whose value is a loop count
        self.deep = _Level(_Level(_Level(1)))  # config.sub.sub.n: three objects deep
        self.hydra = _Level(_Level(_Level(_Level(_Level(_Level(0))))))  # cfg.model.attn.sub...: six objects deep

    def forward(self, x):
        six = self.hydra.inner.inner.inner.inner.inner.inner
        for _ in range(self.namespace.n + int(self.reps) + self.deep.inner.inner.inner + six - 2):
            x = self.fc(self.scale(x))
        return x


def _repeat_rows(x, times):
    return x.repeat(times, 1)


class _Level:
    def __init__(self, inner):
        self.inner = inner


@pytest.mark.parametrize("backward", [False, True])
def test_held_objects_by_contents_and_tensors_read_by_value(backward):
    model = Held()
    wrapper = fxflops.instrument(model, backward=backward)
    _check(wrapper, model, backward, "traced")
    changes = [
        ("a SimpleNamespace attribute", lambda: setattr(model.namespace, "n", 2)),
        ("a partial's keywords in place", lambda: model.scale.keywords.update(times=2)),
        ("a tensor's value in place", lambda: model.reps.fill_(2)),
        ("a tensor replaced", lambda: setattr(model, "reps", torch.tensor(1))),
        ("three objects deep", lambda: setattr(model.deep.inner.inner, "inner", 2)),
        ("six objects deep (a hydra-style config)", lambda: setattr(model.hydra.inner.inner.inner.inner.inner, "inner", 1)),
    ]
    for label, change in changes:
        change()
        _check(wrapper, model, backward, label)


# A settings module and a package of layers, as a code base imports them (``import settings``;
# ``settings.EXTRA``): the model reads their attributes, not names of its own module.
settings = types.ModuleType("fxflops_test_settings")
settings.EXTRA, settings.calls = False, 0
settings.layers = types.ModuleType("fxflops_test_settings.layers")
HELPER_REPEATS = 1  # a global of a helper the model reaches only through a module attribute


def _helper_through_a_module(h, fc):
    for _ in range(HELPER_REPEATS):
        h = fc(h)
    return h


settings.layers.extra = _helper_through_a_module


class Flags:
    FUSED = False  # a class-level switch the model reads on the class


class Rotary:
    @staticmethod
    def apply(h, fc):  # reached through the class: its code is walked too
        return fc(h) if Flags.FUSED else h


class ThroughModulesAndClasses(nn.Module):
    WIDE = False  # read on the module's class, which no attribute access on the module records

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        settings.calls += 1  # the code's own bookkeeping on a module: not a situation
        h = self.fc(x)
        if settings.EXTRA:
            h = self.fc(h)
        if os.environ.get("FXFLOPS_TEST_EXTRA") == "1":
            h = self.fc(h)
        if type(self).WIDE:
            h = self.fc(h)
        return settings.layers.extra(Rotary.apply(h, self.fc), self.fc)


@pytest.mark.parametrize("backward", [False, True])
def test_settings_read_through_a_module_or_a_class_guard_their_programs(backward, monkeypatch):
    global HELPER_REPEATS
    model = ThroughModulesAndClasses()
    wrapper = fxflops.instrument(model, backward=backward)
    monkeypatch.delenv("FXFLOPS_TEST_EXTRA", raising=False)
    try:
        _check(wrapper, model, backward, "traced")
        captures = wrapper.captures
        _check(wrapper, model, backward, "again: the module's counter changed, no new program")
        assert wrapper.captures == captures
        changes = [
            ("a module attribute", lambda: setattr(settings, "EXTRA", True)),
            ("an environment variable", lambda: monkeypatch.setenv("FXFLOPS_TEST_EXTRA", "1")),
            ("a class attribute read on a global class", lambda: setattr(Flags, "FUSED", True)),
            ("a class attribute read on type(self)", lambda: setattr(ThroughModulesAndClasses, "WIDE", True)),
            ("a global of a helper reached through a module", lambda: globals().update(HELPER_REPEATS=3)),
            ("a helper replaced in a nested module", lambda: setattr(settings.layers, "extra", lambda h, fc: h)),
        ]
        for label, change in changes:
            change()
            _check(wrapper, model, backward, label)
        for label, change in [
            ("all back", lambda: None),
            ("module attribute back", lambda: setattr(settings, "EXTRA", False)),
            ("environment back", lambda: monkeypatch.delenv("FXFLOPS_TEST_EXTRA")),
        ]:
            change()
            _check(wrapper, model, backward, label)
    finally:
        settings.EXTRA, Flags.FUSED, ThroughModulesAndClasses.WIDE, HELPER_REPEATS = False, False, False, 1
        settings.layers.extra = _helper_through_a_module


class ThroughTorchSettings(nn.Module):
    """Branches on torch's process-wide settings, read by calling their getters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.extra = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if torch.get_num_threads() == 1:  # a single-threaded fallback path
            h = self.extra(h)
        if float32_matmul_precision() == "high":  # imported by name
            h = self.extra(h)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() >= 1:  # a parallel path
            h = self.extra(h)
        if torch.backends.cudnn.deterministic:  # a flag of torch.backends (a property reading the setting)
            h = self.extra(h)
        if cuda_backend.matmul.allow_tf32:  # through an imported module and a flag holder object
            h = self.extra(h)
        return h


@pytest.mark.parametrize("backward", [False, True])
def test_torch_settings_the_code_reads_through_getters_guard_their_programs(backward):
    model = ThroughTorchSettings()
    wrapper = fxflops.instrument(model, backward=backward)
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    deterministic, tf32 = torch.backends.cudnn.deterministic, torch.backends.cuda.matmul.allow_tf32
    assert precision == "highest" and not torch.distributed.is_initialized() and not deterministic and not tf32
    steps = [
        ("traced", lambda: None),
        ("another number of threads", lambda: torch.set_num_threads(2 if threads == 1 else 1)),
        ("threads back", lambda: torch.set_num_threads(threads)),
        ("matmul precision high", lambda: torch.set_float32_matmul_precision("high")),
        ("precision back", lambda: torch.set_float32_matmul_precision(precision)),
        ("a process group", lambda: torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)),
        ("process group destroyed", torch.distributed.destroy_process_group),
        ("cuDNN deterministic", lambda: setattr(torch.backends.cudnn, "deterministic", True)),
        ("TF32 matmuls allowed", lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True)),
        ("both back", lambda: (setattr(torch.backends.cudnn, "deterministic", False), setattr(torch.backends.cuda.matmul, "allow_tf32", False))),
    ]
    try:
        for label, change in steps:
            change()
            _check(wrapper, model, backward, label)
        captures = wrapper.captures
        _check(wrapper, model, backward, "again: no new program")
        assert wrapper.captures == captures
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.deterministic, torch.backends.cuda.matmul.allow_tf32 = deterministic, tf32
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _round_trip(program, how: str):
    if how == "deepcopy":
        return copy.deepcopy(program)
    if how == "pickle":
        return pickle.loads(pickle.dumps(program))
    buffer = io.BytesIO()
    torch.save(program, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_or_load_made_after_a_setting_changed_keeps_the_traced_value(how):
    """A copied or loaded program finds the objects its code reads again (identities do not survive
    a copy), but a plain value it read (a module's flag, a torch setting) is the traced one: a copy
    made after the value changed refuses the calls it no longer fits, never takes the new value as
    its own."""
    x = torch.randn(5, 8)
    threads = torch.get_num_threads()
    model = ThroughTorchSettings()
    program = fxflops.trace(model, (x,))
    other = ThroughModulesAndClasses()
    traced = fxflops.trace(other, (x,))
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        settings.EXTRA = True
        copies = _round_trip(program, how), _round_trip(traced, how)
        with pytest.raises(fxflops.GuardError, match=r"torch.get_num_threads\(\)"):
            copies[0].count(x)
        with pytest.raises(fxflops.GuardError, match="EXTRA"):
            copies[1].count(x)
        torch.set_num_threads(threads)
        settings.EXTRA = False
        assert copies[0].count(x) == flop_counter_call(model, (x,), {}, backward=False)
        assert copies[1].count(x) == flop_counter_call(other, (x,), {}, backward=False)
    finally:
        torch.set_num_threads(threads)
        settings.EXTRA = False


def _helper_twice(h, fc):  # another helper, defined as a module's function (pickled by reference)
    return fc(fc(h))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_or_load_made_after_a_helper_was_replaced_does_not_take_it_as_traced(how):
    """A function the model's code reaches (``settings.layers.extra``) is found again by a copy or
    a loaded program (a copy's own objects); one replaced since the trace (by another function of the
    same or another name, or a lambda) is not the traced helper: its calls are refused, naming it,
    until the traced helper is back."""
    x = torch.randn(5, 8)
    model = ThroughModulesAndClasses()
    program = fxflops.trace(model, (x,))
    traced = flop_counter_call(model, (x,), {}, backward=False)
    try:
        for replacement in (_helper_twice, functools.partial(_helper_through_a_module), torch.nn.functional.linear):
            settings.layers.extra = replacement
            copied = _round_trip(program, how)
            with pytest.raises(fxflops.GuardError, match="extra"):
                copied.count(x)
            settings.layers.extra = _helper_through_a_module
            assert copied.count(x) == traced, replacement
        assert _round_trip(program, how).count(x) == traced  # the traced helper itself: counted
    finally:
        settings.layers.extra = _helper_through_a_module


class ReadsInputAttributes(nn.Module):
    """Reads Python attributes a data pipeline set on its input tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.extra = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, more=()):
        h = self.fc(x)
        if getattr(x, "packed", False):
            h = self.extra(h)
        for _ in range(getattr(x, "repeats", 0)):
            h = self.extra(h)
        for m in more:
            if getattr(m, "packed", False):
                h = h + self.extra(m)
        return h


def _with_attributes(tensor, **attributes):
    tensor.__dict__.update(attributes)
    return tensor


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("first", ["plain", "with attributes"])
def test_python_attributes_of_input_tensors_are_part_of_the_call(backward, first):
    model = ReadsInputAttributes()
    wrapper = fxflops.instrument(model, backward=backward)
    x = lambda **a: _with_attributes(torch.randn(5, 8), **a)  # noqa: E731
    calls = [
        ("no attributes", lambda: (x(),)),
        ("a flag set", lambda: (x(packed=True),)),
        ("a flag cleared", lambda: (x(packed=False),)),
        ("a count", lambda: (x(repeats=2),)),
        ("another count", lambda: (x(repeats=3),)),
        ("on a tensor in a list", lambda: (x(), [x(packed=True)])),
        ("not on it", lambda: (x(), [x()])),
        ("a tensor attribute: measured", lambda: (x(packed=torch.ones(())),)),
        ("an object attribute: measured", lambda: (x(packed=types.SimpleNamespace()),)),
        ("no attributes again", lambda: (x(),)),
    ]
    if first != "plain":
        calls.insert(0, calls.pop(3))
    for label, args in calls:
        assert_counted_call(wrapper, model, args(), backward, label)
    assert wrapper.measured  # the calls whose inputs hold more than plain values


def test_a_tensor_subclass_s_own_attributes_are_not_the_call_s():
    """A FakeTensor's ``__dict__`` holds its mode: its inputs are traced as any tensor is (one
    program for every size), not measured as if a user had put an object on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = ReadsInputAttributes()
    wrapper = fxflops.instrument(model)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        for rows in (4, 5, 6):
            x = torch.randn(rows, 8)
            assert x.__dict__  # the subclass's own machinery
            assert_counted_call(wrapper, model, (x,), False, rows)
    assert wrapper.captures == 1 and not wrapper.measured


@dataclasses.dataclass
class _RunConfig:
    extra: bool = False
    deep: types.SimpleNamespace = dataclasses.field(default_factory=lambda: types.SimpleNamespace(n=1))


RUN = _RunConfig()  # a module-level config object (an ``args`` namespace, a dataclass instance)
BLOCKS = {"vit": types.SimpleNamespace(extra=False)}  # a registry of settings objects by name
TABLE = torch.randn(8, 8)  # a module-level weight the forward multiplies by
_HELPER_DEFAULTS = types.SimpleNamespace(extra=False)
_GLOBAL_ARGS = types.SimpleNamespace(extra=False)  # parsed arguments kept by a getter, as Megatron-LM keeps them


def get_args():
    assert _GLOBAL_ARGS is not None, "arguments not initialised"
    return _GLOBAL_ARGS


_CACHED_SETTINGS = types.SimpleNamespace(extra=False)


@functools.lru_cache(maxsize=None)
def get_settings():
    return _CACHED_SETTINGS


def _with_defaults(h, fc, opts=_HELPER_DEFAULTS):
    return fc(h) if opts.extra else h


def _objects_model():
    held = types.SimpleNamespace(extra=False)  # a settings object a closure holds

    class ThroughObjects(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            args = get_args()
            h = self.fc(x)
            if args.extra:
                h = self.fc(h)
            if get_settings().extra:  # an lru_cache'd getter
                h = self.fc(h)
            if RUN.extra:
                h = self.fc(h)
            for _ in range(RUN.deep.n):
                h = self.fc(h)
            if held.extra:
                h = self.fc(h)
            if BLOCKS["vit"].extra:
                h = self.fc(h)
            return _with_defaults(h, self.fc) @ TABLE

    return ThroughObjects(), held


@pytest.mark.parametrize("backward", [False, True])
def test_objects_and_tensors_the_code_reads_outside_the_model_guard_their_programs(backward):
    global RUN, TABLE, _GLOBAL_ARGS
    model, held = _objects_model()
    wrapper = fxflops.instrument(model, backward=backward)
    original_run, original_table, original_args = RUN, TABLE, _GLOBAL_ARGS
    try:
        _check(wrapper, model, backward, "traced")
        changes = [
            ("a global object's attribute", lambda: setattr(RUN, "extra", True)),
            ("an attribute two objects deep", lambda: setattr(RUN.deep, "n", 3)),
            ("the object in between replaced", lambda: setattr(RUN, "deep", types.SimpleNamespace(n=2))),
            ("the global rebound to another object", lambda: globals().update(RUN=_RunConfig())),
            ("an object a closure holds", lambda: setattr(held, "extra", True)),
            ("an object in a global dict", lambda: setattr(BLOCKS["vit"], "extra", True)),
            ("a helper's default object", lambda: setattr(_HELPER_DEFAULTS, "extra", True)),
            ("an object a getter returns", lambda: setattr(_GLOBAL_ARGS, "extra", True)),
            ("the getter's global rebound", lambda: globals().update(_GLOBAL_ARGS=types.SimpleNamespace(extra=False))),
            ("an object an lru_cache'd getter returns", lambda: setattr(_CACHED_SETTINGS, "extra", True)),
            ("a global tensor of another shape", lambda: globals().update(TABLE=torch.randn(8, 24))),
            ("a global tensor resized in place", lambda: TABLE.resize_(8, 16)),
        ]
        for label, change in changes:
            change()
            _check(wrapper, model, backward, label)
    finally:
        RUN, TABLE, _GLOBAL_ARGS = original_run, original_table, original_args
        _GLOBAL_ARGS.extra = False
        BLOCKS["vit"].extra = _HELPER_DEFAULTS.extra = _CACHED_SETTINGS.extra = False


class _Settings:
    """A settings object whose methods and properties the forward calls: what they read on ``self``
    (and on the class) is the call's situation, as an attribute the forward reads directly is."""

    REPEATS = 1  # a class attribute read through the object

    def __init__(self) -> None:
        self.on = False
        self._depth = 1
        self.nested = types.SimpleNamespace(wide=False)

    def enabled(self):
        return self.on

    def doubled(self):
        return self.enabled() and self.nested.wide  # a method calling another, and an object two deep

    @property
    def depth(self):
        return self._depth

    @classmethod
    def repeats(cls):
        return cls.REPEATS


OPTIONS = _Settings()


class ThroughMethods(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if OPTIONS.enabled():
            h = self.fc(h)
        if OPTIONS.doubled():
            h = self.fc(self.fc(h))
        for _ in range(OPTIONS.depth + OPTIONS.repeats() + OPTIONS.REPEATS):
            h = self.fc(h)
        return h


@pytest.mark.parametrize("backward", [False, True])
def test_what_methods_of_a_global_object_read_guards_their_programs(backward):
    model = ThroughMethods()
    wrapper = fxflops.instrument(model, backward=backward)
    enabled = _Settings.enabled
    try:
        _check(wrapper, model, backward, "traced")
        changes = [
            ("an attribute a method reads", lambda: setattr(OPTIONS, "on", True)),
            ("an object two deep, read by a method another calls", lambda: setattr(OPTIONS.nested, "wide", True)),
            ("an attribute a property reads", lambda: setattr(OPTIONS, "_depth", 3)),
            ("a class attribute a class method and the forward read", lambda: setattr(_Settings, "REPEATS", 2)),
            ("the attribute back", lambda: setattr(OPTIONS, "on", False)),
            ("a method replaced on the class", lambda: setattr(_Settings, "enabled", lambda self: True)),
            ("the class attribute back", lambda: setattr(_Settings, "REPEATS", 1)),
        ]
        for label, change in changes:
            change()
            _check(wrapper, model, backward, label)
    finally:
        _Settings.enabled, _Settings.REPEATS = enabled, 1
        OPTIONS.__init__()


class _AttrDict(dict):
    """The common config idiom whose missing attributes raise KeyError, not AttributeError."""

    __getattr__ = dict.__getitem__
    __setattr__ = dict.__setitem__


class _Strict:
    """Slots and a ``__getattr__`` raising for any name it lacks (a proxy, a lazy config)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 1

    def __getattr__(self, name):
        raise RuntimeError(f"no setting {name}")


ATTR_OPTIONS = _AttrDict(n=1)


class _ReadsAttrDicts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.cfg, self.strict = _AttrDict(n=1), _Strict()

    def forward(self, x, opts):
        for _ in range(ATTR_OPTIONS.n + self.cfg.n + self.strict.n + opts.n):
            x = self.fc(x)
        return x


@pytest.mark.parametrize("backward", [False, True])
def test_objects_whose_getattr_raises_other_errors_are_counted_and_guarded(backward):
    """A global AttrDict, one a module holds, an argument and a held object whose ``__getattr__``
    raises other than AttributeError: every call counted (was: not counted at all, "internal error
    KeyError: '__self__'"), and a setting changed in each is counted as it runs."""
    model = _ReadsAttrDicts()
    wrapper = fxflops.instrument(model, backward=backward)
    opts = _AttrDict(n=1)
    x = torch.randn(4, 8)
    changes = [
        ("as built", lambda: None), ("a global AttrDict", lambda: setattr(ATTR_OPTIONS, "n", 2)),
        ("a held AttrDict", lambda: setattr(model.cfg, "n", 2)), ("a held object with slots", lambda: setattr(model.strict, "n", 2)),
        ("an argument AttrDict", lambda: setattr(opts, "n", 2)),
    ]
    try:
        for label, change in changes:
            change()
            assert_counted_call(wrapper, model, (x, opts), backward, label)
    finally:
        ATTR_OPTIONS.n = 1


class _SkipsFrozen(nn.Module):
    """Applies its side branch only while it trains (``if weight.requires_grad``), as code
    that skips frozen branches does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.side = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return self.side(h) if self.side.weight.requires_grad else h


def test_a_forward_reading_requires_grad_is_counted_as_it_runs_under_no_grad():
    """Under no_grad the trace still follows ``requires_grad``: the side branch frozen, and trained
    again, each call counted as it runs (was the first call's count: 1024 vs 512)."""
    model = _SkipsFrozen()
    wrapper = fxflops.instrument(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for step, trains in enumerate((True, False, True)):
            model.side.requires_grad_(trains)
            assert_counted_call(wrapper, model, (x,), False, (step, trains))


class _Flag:
    on = False  # a class default, set on an instance later
    repeats = 1

    def count(self):
        return self.repeats


FLAG_LIST = [_Flag()]  # objects in a module-level list, read by a constant index


class _ClassAndBoundMethods(nn.Module):
    N = 1

    def __init__(self, count) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.count = count  # a bound method of an object outside the model

    @classmethod
    def repeats(cls):
        return cls.N

    def forward(self, x):
        for _ in range(self.repeats() + self.count()):
            x = self.fc(x)
        if FLAG_LIST[0].on:
            x = self.fc(x)
        return x


@pytest.mark.parametrize("backward", [False, True])
def test_class_methods_held_bound_methods_and_listed_objects_guard_their_programs(backward):
    """A module's class method reading ``cls.N``, a bound method of an outside object held by a
    module, an object read from a module-level list by index (``FLAG_LIST[0].on``), class defaults
    set on the instance: each change, and back, counted as it runs (was the first call's count)."""
    counter = _Flag()
    model = _ClassAndBoundMethods(counter.count)
    wrapper = fxflops.instrument(model, backward=backward)
    steps = [
        ("as built", lambda: None), ("a class attribute a class method reads", lambda: setattr(_ClassAndBoundMethods, "N", 2)),
        ("a class default set on the held method's object", lambda: setattr(counter, "repeats", 3)),
        ("a class default set on a listed object", lambda: setattr(FLAG_LIST[0], "on", True)),
        ("the listed object replaced", lambda: FLAG_LIST.__setitem__(0, _Flag())),
        ("the class default changed", lambda: setattr(_Flag, "on", True)),
    ]
    try:
        for label, change in steps:
            change()
            _check(wrapper, model, backward, label)
    finally:
        _ClassAndBoundMethods.N, _Flag.on = 1, False
        FLAG_LIST[0] = _Flag()


class _DictBacked:
    """Keeps its settings in a dict behind ``__getattr__``."""

    def __init__(self) -> None:
        self._settings = {"n": 1}

    def __getattr__(self, name):
        try:
            return self._settings[name]
        except KeyError:
            raise AttributeError(name) from None


class _Slotted:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 1


class _Cached:
    base = 1

    @functools.cached_property
    def n(self):
        return self.base


class _Setting:
    """A descriptor computing the value a module reads (a setting looked up elsewhere)."""

    value = 1

    def __get__(self, obj, owner=None):
        return type(self).value


DICT_BACKED, SLOTTED, CACHED = _DictBacked(), _Slotted(), _Cached()


class _ReadsSettingsObjects(nn.Module):
    repeats = _Setting()

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(DICT_BACKED.n + SLOTTED.n + CACHED.n + self.repeats):
            x = self.fc(x)
        return x


@pytest.mark.parametrize("backward", [False, True])
def test_settings_objects_of_every_shape_guard_their_programs(backward):
    """Settings read through ``__getattr__`` over a dict, a slot, a ``cached_property`` recomputed
    after its cache is dropped, and a module's own descriptor: each changed, counted as it runs
    (was the first call's count)."""
    model = _ReadsSettingsObjects()
    wrapper = fxflops.instrument(model, backward=backward)
    steps = [
        ("as built", lambda: None), ("a setting in the dict behind __getattr__", lambda: DICT_BACKED._settings.update(n=2)),
        ("a slot", lambda: setattr(SLOTTED, "n", 2)),
        ("a cached property recomputed", lambda: (setattr(CACHED, "base", 2), vars(CACHED).pop("n", None))),
        ("what a descriptor computes", lambda: setattr(_Setting, "value", 2)),
    ]
    try:
        for label, change in steps:
            change()
            _check(wrapper, model, backward, label)
    finally:
        DICT_BACKED._settings["n"], SLOTTED.n, CACHED.base, _Setting.value = 1, 1, 1, 1
        vars(CACHED).pop("n", None)


class _Lazy:
    """Serves its settings from a dict through ``__getattr__``, raising RuntimeError (not
    AttributeError) for one it does not hold: a lazily loaded config."""

    def __init__(self) -> None:
        self._settings = {"n": 2}

    def __getattr__(self, name):
        if name.startswith("_") or name not in self._settings:
            raise RuntimeError(f"setting {name} not loaded")
        return self._settings[name]


LAZY = _Lazy()


class _ReadsLazySetting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        repeats = 1
        try:
            repeats = LAZY.n
        except RuntimeError:  # not loaded: the default
            pass
        for _ in range(repeats):
            x = self.fc(x)
        return x


@pytest.mark.parametrize("backward", [False, True])
def test_a_setting_whose_lookup_raises_since_is_another_situation(backward):
    """A setting the traced code read, whose lookup raises another error than AttributeError once
    it is gone, makes the call another situation (counted as it runs), not an uncounted call."""
    model = _ReadsLazySetting()
    wrapper = fxflops.instrument(model, backward=backward)
    try:
        _check(wrapper, model, backward, "loaded")
        del LAZY._settings["n"]
        _check(wrapper, model, backward, "no longer loaded")
        assert wrapper.flops.uncounted == 0
    finally:
        LAZY._settings["n"] = 2


class _CallsTorchThroughItsModules(nn.Module):
    """Calls torch's functions through the modules that hold them, as model code does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = nn.functional.linear(x, self.fc.weight)
        q = h.view(1, 1, -1, 8)
        h = torch.nn.functional.scaled_dot_product_attention(q, q, q).view_as(h)
        return torch.matmul(h, self.fc.weight)


_TORCH_LINEAR, _TORCH_MATMUL, _TORCH_ATTENTION = nn.functional.linear, torch.matmul, nn.functional.scaled_dot_product_attention


def _with_adapter(x, weight, bias=None):  # a low-rank adapter patched in: x W^T + (x A^T) B^T
    return _TORCH_LINEAR(x, weight, bias) + _TORCH_LINEAR(_TORCH_LINEAR(x, weight[:2]), weight[:, :2])


def _over_the_whole_sequence(q, k, v, **kwargs):  # a ring attention: each query over keys gathered from two ranks
    return _TORCH_ATTENTION(q, torch.cat([k, k], dim=-2), torch.cat([v, v], dim=-2), **kwargs)


@pytest.mark.parametrize("backward", [False, True])
def test_a_torch_function_patched_in_its_module_is_another_situation(backward, monkeypatch):
    """A torch function the model calls through its module (``F.linear``, ``torch.matmul``,
    ``torch.nn.functional.scaled_dot_product_attention``), patched there between calls (an adapter,
    torch's context parallelism patching attention in its context), runs other work: counted as it
    runs (was the traced function's count)."""
    model = _CallsTorchThroughItsModules()
    wrapper = fxflops.instrument(model, backward=backward)
    _check(wrapper, model, backward, "torch's own functions")
    patches = [
        ("F.linear", lambda: monkeypatch.setattr(nn.functional, "linear", _with_adapter)),
        ("torch.matmul", lambda: monkeypatch.setattr(torch, "matmul", lambda a, b: _TORCH_MATMUL(a, b) + _TORCH_MATMUL(a, b))),
        ("attention", lambda: monkeypatch.setattr(nn.functional, "scaled_dot_product_attention", _over_the_whole_sequence)),
        ("all restored", monkeypatch.undo),
    ]
    for label, patch in patches:
        patch()
        _check(wrapper, model, backward, label)
    assert len(wrapper.programs) == 4


class _Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


class _ScaledProjection(_Projection):
    """Calls its base's forward through ``super()``: a patch of the base's method runs here too."""

    def forward(self, x):
        return super().forward(x) * 2


class _DoubledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def _twice_projected(self, x):
    return self.fc(self.fc(x))


def _twice_linear(self, x):
    return nn.functional.linear(nn.functional.linear(x, self.weight), self.weight, self.bias)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("base", ["model code", "torch"])
def test_a_base_method_reached_through_super_and_patched_is_another_situation(backward, base):
    """A library patching a base class's method (``nn.Linear.forward``, as adapters and quantizers
    do) changes every subclass that calls it through ``super()``; the subclass's own ``forward``,
    which the module's attribute reads see, is unchanged."""
    owner, patch = (_Projection, _twice_projected) if base == "model code" else (nn.Linear, _twice_linear)
    model = _ScaledProjection() if base == "model code" else nn.Sequential(_DoubledLinear(8, 8))
    wrapper = fxflops.instrument(model, backward=backward)
    original = owner.forward
    try:
        _check(wrapper, model, backward, "traced")
        owner.forward = patch
        _check(wrapper, model, backward, "the base's method patched")
        owner.forward = original
        _check(wrapper, model, backward, "restored")
    finally:
        owner.forward = original


def _repeated(h, fc, times):
    for _ in range(times):
        h = fc(h)
    return h


STEP = functools.partial(_repeated, times=1)  # a module-level partial the forward calls
COMBINE = torch.add  # a builtin bound to a global, which a library may replace


class _PartialAndBuiltin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return COMBINE(STEP(x, self.fc), x)


@pytest.mark.parametrize("backward", [False, True])
def test_a_partial_or_builtin_global_replaced_is_another_situation(backward):
    global STEP, COMBINE
    model = _PartialAndBuiltin()
    wrapper = fxflops.instrument(model, backward=backward)
    try:
        _check(wrapper, model, backward, "traced")
        STEP.keywords["times"] = 2
        _check(wrapper, model, backward, "the partial's keywords changed in place")
        STEP = functools.partial(_repeated, times=3)
        _check(wrapper, model, backward, "the partial replaced")
        COMBINE = lambda a, b: a @ b.T @ b  # noqa: E731 - a fused kernel patched in
        _check(wrapper, model, backward, "the builtin replaced")
    finally:
        STEP, COMBINE = functools.partial(_repeated, times=1), torch.add


def test_model_code_in_a_module_named_like_the_standard_library_is_walked(tmp_path, monkeypatch):
    """The standard library's functions are not walked; a project's own ``colorsys.py`` is model
    code, and the globals its model reads guard the program as any module's do."""
    (tmp_path / "colorsys.py").write_text(
        "import torch\n"
        "REPEATS = 1\n"
        "class Repeating(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        for _ in range(REPEATS):\n"
        "            x = self.fc(x)\n"
        "        return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    original = sys.modules.pop("colorsys", None)
    try:
        import importlib

        shadowing = importlib.import_module("colorsys")
        assert shadowing.__file__.startswith(str(tmp_path))
        model = shadowing.Repeating()
        wrapper = fxflops.instrument(model)
        _check(wrapper, model, False, "traced")
        shadowing.REPEATS = 3
        _check(wrapper, model, False, "the global of a module named like the standard library's changed")
    finally:  # the standard library's colorsys back for the rest of the process (matplotlib imports it)
        sys.modules.pop("colorsys", None)
        if original is not None:
            sys.modules["colorsys"] = original


class Takes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, how=None, **named):
        if how is not None:
            x = how(x)
        first = next(iter(named.values()), None)
        if first is not None:
            x = x.repeat(first.shape[0] // x.shape[0], 1)
        return self.fc(x)


def test_callable_and_array_arguments_are_keyed_by_contents_and_kwargs_by_order():
    import numpy as np

    model = Takes()
    wrapper = fxflops.instrument(model)

    def call(label, *args, **kwargs):
        x = torch.randn(4, 8)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(x, *args, **kwargs)
        assert wrapper.flops.total() == flop_counter_call(model, (x, *args), kwargs, False), label

    for k in (1, 2, 3, 2):  # a fresh callable per call, possibly at a freed one's address
        call(f"partial repeats={k}", functools.partial(torch.Tensor.repeat, repeats=(k, 1)))
        call(f"lambda over k={k}", (lambda k: lambda h: h.repeat(k, 1))(k))
        call(f"array [{k}]", _ArrayRepeat(np.array([k])))
    call("kwargs a then b", a=torch.zeros(4, 8), b=torch.zeros(8, 8))
    call("kwargs b then a", b=torch.zeros(8, 8), a=torch.zeros(4, 8))


class _ArrayRepeat:
    __slots__ = ("times",)  # an object without __dict__: keyed by its slots' values

    def __init__(self, times):
        self.times = times

    def __call__(self, h):
        return h.repeat(int(self.times[0]), 1)


SETTINGS = {"layers": 3}  # a module-level setting changed in place
SKIPPED: set[int] = set()
SIGNS = [1] * 200  # more values than a small container: still compared by value
_SEEN: dict[str, int] = {}  # a registry the code fills in place: not a situation


class InPlace(nn.Module):
    """Settings in module-level containers and a closure's list, read by the code, changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        order = [0, 1, 2]

        def chosen():
            return [i for i in order if i not in SKIPPED]

        self.chosen, self.order = chosen, order

    def forward(self, x):
        _SEEN.setdefault("calls", 0)
        _SEEN["calls"] += 1
        for i in self.chosen():
            if i < SETTINGS["layers"] and SIGNS[i] > 0:
                x = self.layers[i](x)
        return x


@pytest.mark.parametrize("backward", [False, True])
def test_containers_the_code_reads_changed_in_place_guard_their_programs(backward):
    model = InPlace()
    wrapper = fxflops.instrument(model, backward=backward)
    try:
        _check(wrapper, model, backward, "traced")
        changes = [  # each leaves at least one layer running (a backward needs one)
            ("a module-level dict entry", lambda: SETTINGS.update(layers=2)),
            ("an item added to a module-level set", lambda: SKIPPED.add(0)),
            ("the dict entry back", lambda: SETTINGS.update(layers=3)),
            ("an item of a 200-item module-level list", lambda: SIGNS.__setitem__(1, -1)),
            ("the set emptied", SKIPPED.clear),
            ("a closure's list in place", lambda: model.order.remove(2)),
            ("all back", lambda: (SIGNS.__setitem__(1, 1), model.order.append(2))),
        ]
        for label, change in changes:
            change()
            _check(wrapper, model, backward, label)
        captures = wrapper.captures
        for _ in range(3):
            _check(wrapper, model, backward, "the registry the code fills changed: no new program")
        assert wrapper.captures == captures
    finally:
        SETTINGS["layers"], SIGNS[1] = 3, 1
        SKIPPED.clear()


class Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.frozen_ids = set(range(100, 200))  # a large set attribute: compared by contents

    def forward(self, x, skip=frozenset()):
        for i, layer in enumerate(self.layers):
            if i not in skip and 100 + i not in self.frozen_ids:
                x = layer(x)
        return x


def test_set_arguments_and_attributes_are_compared_by_contents():
    model = Skips()
    wrapper = fxflops.instrument(model)

    def call(label, *args):
        x = torch.randn(4, 8)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(x, *args)
        assert wrapper.flops.total() == flop_counter_call(model, (x, *args), {}, False), label

    skip = {1}
    call("a set argument", skip)
    skip.add(2)
    call("the same set argument changed in place", skip)
    for k in (0, 3, 0):  # a fresh set per call, possibly at a freed one's address
        call(f"a fresh set {{{k}}}", {k})
    call("a frozenset", frozenset({0, 1}))
    model.frozen_ids.discard(101)
    call("the set attribute changed in place")
    model.frozen_ids.add(101)
    call("and back")


class Logging(nn.Module):
    """Keeps logs and a cache its own code and a hook fill on every call, and a list setting it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.records: list = []  # the forward appends to it
        self.norms: dict = {}  # the forward fills it by subscript
        self.seen: list = []  # a hook extends it
        self.order = [0, 1, 2]  # a setting: read, never filled by the code
        self.register_forward_hook(lambda module, args, out: module.seen.extend(out.shape))

    def forward(self, x):
        for i in self.order:
            x = self.layers[i](x)
            self.records.append(x.shape[0])
            self.norms[len(self.norms)] = float(x.shape[-1])
        if len(self.order) > 5:  # a branch on the setting's length: a list changed in place is another situation
            x = x * 2
        return x


@pytest.mark.parametrize("backward", [False, True])
def test_logs_and_caches_the_code_fills_are_not_a_new_situation(backward):
    model = Logging()
    wrapper = fxflops.instrument(model, backward=backward)
    for n in range(2, 6):
        assert_counted_call(wrapper, model, (torch.randn(n, 8),), backward, f"batch {n}")
    assert wrapper.captures == 1, "a log appended to by the forward or a hook made another situation"
    assert len(model.records) > 0 and len(model.seen) > 0
    model.order.remove(1)  # the setting changed in place: another situation
    assert_counted_call(wrapper, model, (torch.randn(4, 8),), backward, "the setting changed")
    model.order[:] = [0, 1, 2, 0, 1, 2]
    assert_counted_call(wrapper, model, (torch.randn(4, 8),), backward, "the setting lengthened past the branch")
    assert wrapper.captures == 3
    model.records = []  # a log replaced by a fresh one: another object, another program (never stale)
    assert_counted_call(wrapper, model, (torch.randn(4, 8),), backward, "the log replaced")


class Memory(nn.Module):
    """Keeps a memory it appends to and attends over on the next call (Transformer-XL style)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.mems: list = []
        self.seen: dict = {}

    def forward(self, x):
        h = self.fc(x)
        if self.mems:
            memory = torch.cat(self.mems)
            h = h + (h @ memory.T) @ memory
        self.mems.append(h.detach())
        self.seen[len(self.seen)] = 1  # filled by subscript
        if len(self.seen) % 2:  # and read: its contents choose the work
            h = self.fc(h)
        return h


class _Bank:
    """A plain object whose own method reads the memory (code the model-state walk does not follow)."""

    def __init__(self) -> None:
        self.mems: list = []

    def read(self):
        return torch.cat(self.mems) if self.mems else None


class BankMemory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bank = _Bank()

    def forward(self, x):
        h = self.fc(x)
        memory = self.bank.read()
        if memory is not None:
            h = h + (h @ memory.T) @ memory
        self.bank.mems.append(h.detach())  # the forward itself only fills it
        return h


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("kind", [Memory, BankMemory])
def test_a_container_the_code_fills_and_reads_is_compared_by_value(backward, kind):
    model = kind()
    wrapper = fxflops.instrument(model, backward=backward)
    for n in range(2, 7):  # the memory grows by n rows per call: every call attends over more
        x = torch.randn(n, 8)
        reference = copy.deepcopy(model)
        wrapper.flops.reset()
        out = wrapper(x)
        if backward:
            out.sum().backward()
        assert wrapper.flops.uncounted == 0
        assert wrapper.flops.total() == flop_counter_call(reference, (x,), {}, backward=backward), f"call {n}"


TIMES = 1  # a setting a function passed to the forward reads


def _repeat_by_setting(h):
    return h.repeat(TIMES, 1)


_PRODUCTS: dict = {}  # a memo: filled by the code, then read; an entry there skips its work
_GRAM = None  # made lazily by the code: once set, its work is skipped


def _product_memo():
    """A memo held in a closure (found through the cell the function loads)."""
    products: dict = {}

    def product(weight):
        if "gram" not in products:
            products["gram"] = weight @ weight.T
        return products["gram"]

    return product, products


class Memoizing(nn.Module):
    """Work done once and kept: a module-level dict, a closure's dict, a module-level dict filled
    through a local alias (code that is not seen filling it), and a global the code sets lazily."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.where = where
        self.product, self.closure_cache = _product_memo()

    def forward(self, x):
        weight = self.fc.weight.detach()
        if self.where == "global":
            if "gram" not in _PRODUCTS:
                _PRODUCTS["gram"] = weight @ weight.T
            gram = _PRODUCTS["gram"]
        elif self.where == "closure":
            gram = self.product(weight)
        elif self.where == "alias":
            kept = _PRODUCTS
            if "gram" not in kept:
                kept["gram"] = weight @ weight.T
            gram = kept["gram"]
        else:
            global _GRAM
            if _GRAM is None:
                _GRAM = weight @ weight.T
            gram = _GRAM
        return self.fc(x) @ gram

    def clear(self) -> None:
        global _GRAM
        _PRODUCTS.clear()
        self.closure_cache.clear()
        _GRAM = None


def _measured_call(wrapper, x, backward: bool) -> int:
    """FlopCounterMode around the real call itself: what ran, with the memo as it was (a second
    run of the model for the reference would find the memo the first one filled)."""
    wrapper.flops.reset()
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        out = wrapper(x)
        if backward:
            out.sum().backward()
    assert wrapper.flops.uncounted == 0
    return counter.get_total_flops()


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("where", ["global", "closure", "alias", "lazy"])
def test_a_memo_the_code_fills_and_reads_is_compared_by_its_entries(backward, where):
    """The first call computes the product and keeps it; later calls skip that work. Compared by
    identity (as a log is), the memo would keep the first call's program: every later call
    overcounted by the product's FLOPs."""
    model = Memoizing(where)
    model.clear()
    wrapper = fxflops.instrument(model, backward=backward)
    sizes = [3, 5, 5, "clear", 7, 4]
    for n in sizes:
        if n == "clear":  # emptied by the user: the work runs again
            model.clear()
            continue
        expected = _measured_call(wrapper, torch.randn(n, 8), backward)
        assert wrapper.flops.total() == expected, f"{where}: batch {n}"
    assert wrapper.captures == 2  # memo empty, memo filled (the state after the clear is the first's)
    model.clear()


@functools.lru_cache(maxsize=None)
def _gram_of_ones(n: int) -> torch.Tensor:
    ones = torch.ones(n, n)
    return ones @ ones


def _lru_behind_a_wrapper(function):
    """A decorator whose wrapper calls an lru cache held in its closure (transformers'
    ``compile_compatible_method_lru_cache`` is one)."""
    cached = functools.lru_cache(maxsize=4)(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return cached(*args, **kwargs)

    wrapper.cache = cached
    return wrapper


@_lru_behind_a_wrapper
def _wrapped_gram(n: int) -> torch.Tensor:
    ones = torch.ones(n, n)
    return ones @ ones


class LruMemoizing(nn.Module):
    """Matmul work done inside an lru-cached function: only on a miss. The tail's own code calls
    it (a module-level cache, a static method's, or one behind a decorator's wrapper)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.tail = _LruTail(where)

    def forward(self, x):
        return self.tail(self.fc(x))

    def cache(self):
        return {"global": _gram_of_ones, "static": _LruTail.gram, "wrapped": _wrapped_gram.cache}[self.tail.where]


class _LruTail(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.fc = where, nn.Linear(8, 8)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def gram(n: int) -> torch.Tensor:
        ones = torch.ones(n, n)
        return ones @ ones

    def forward(self, h):
        gram = {"global": _gram_of_ones, "static": _LruTail.gram, "wrapped": _wrapped_gram}[self.where](8)
        return self.fc(h @ gram)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("where", ["global", "static", "wrapped"])
def test_work_an_lru_cache_may_skip_is_counted_as_it_runs(backward, where):
    """The capture calls a cache of its own (it must: the user's never gets a fake), which starts
    empty, so the trace always computes. The program is used only while the user's cache is empty
    too; with entries, the module calling the cache is measured per call (a hit costs nothing,
    a miss its matmul). Before, every call after the first overcounted by the cached matmul."""
    model = LruMemoizing(where)
    model.cache().cache_clear()
    wrapper = fxflops.instrument(model, backward=backward)
    for n in [3, 5, "clear", 7, 4]:
        if n == "clear":  # emptied by the user: the work runs again
            model.cache().cache_clear()
            continue
        expected = _measured_call(wrapper, torch.randn(n, 8), backward)
        assert wrapper.flops.total() == expected, f"{where}: batch {n}"
    assert wrapper.captures == 1  # the program of the empty cache, used again after the clear
    assert set(wrapper.measured) == {"tail"} and "lru_cache" in wrapper.measured["tail"]  # the smallest measured set
    model.cache().cache_clear()


class Swallowing(nn.Module):
    """Model code that catches any error around a cached helper (and then computes without it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        try:
            gram = _gram_of_ones(8)
        except Exception:  # noqa: BLE001 - the model's own broad except, as some code has
            gram = torch.eye(8)
        return self.fc(x) @ gram


def test_an_lru_refusal_the_models_code_catches_still_refuses():
    model = Swallowing()
    _gram_of_ones.cache_clear()
    wrapper = fxflops.instrument(model)
    for n in [3, 5, 6]:  # empty (the trace is the call), then filled: measured, a hit costs nothing
        expected = _measured_call(wrapper, torch.randn(n, 8), False)
        assert wrapper.flops.total() == expected, f"batch {n}"
    assert set(wrapper.measured) == {""}
    _gram_of_ones.cache_clear()


def test_a_cached_helper_replaced_is_another_situation(monkeypatch):
    """A global bound to an lru cache is compared by identity (a helper patched in, as fused
    kernels are), and the function it caches is followed: its globals guard the program too."""
    model = LruMemoizing("global")
    _gram_of_ones.cache_clear()
    wrapper = fxflops.instrument(model)
    assert _measured_call(wrapper, torch.randn(3, 8), False) == wrapper.flops.total()
    monkeypatch.setattr(sys.modules[__name__], "_gram_of_ones", functools.lru_cache(lambda n: torch.eye(n)))
    assert _measured_call(wrapper, torch.randn(3, 8), False) == wrapper.flops.total(), "the helper replaced"
    reads = {read.label.split(" ")[0] for program in wrapper.programs for read in program.state.code}
    assert any(label.endswith("._gram_of_ones") for label in reads)


def test_an_attention_function_registered_over_the_one_traced_is_another_situation(monkeypatch):
    """transformers picks the attention function from ``ALL_ATTENTION_FUNCTIONS``, a registry object
    (not a dict) keeping its entries in dicts: one registered over ``"sdpa"`` after the first call
    (a patch, a fused kernel) computes something else, so it gets its own program."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = _tiny_llama(1, "sdpa").eval()
    wrapper = fxflops.instrument(model)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert_counted_call(wrapper, model, (), False, "traced", {"input_ids": ids})

    def rotated_first(module, query, key, value, attention_mask, **kwargs):  # one more matmul per call
        return sdpa_attention_forward(module, query @ torch.eye(query.shape[-1]), key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", rotated_first)
    with torch.no_grad():
        assert_counted_call(wrapper, model, (), False, "another sdpa registered", {"input_ids": ids})
    assert wrapper.captures == 2


def test_a_torch_function_patched_under_the_registered_attention_function_is_another_situation(monkeypatch):
    """transformers' sdpa models call ``torch.nn.functional.scaled_dot_product_attention`` from the
    function registered under ``"sdpa"`` (``sdpa_attention_forward``), not from the model's own code:
    the registry's function chosen by the config's string is walked as model code, so attention
    patched in torch's module (a ring attention over gathered keys) is another situation (was the
    traced count)."""
    model = _tiny_llama(1, "sdpa").eval()
    wrapper = fxflops.instrument(model)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert_counted_call(wrapper, model, (), False, "traced", {"input_ids": ids})
        monkeypatch.setattr(nn.functional, "scaled_dot_product_attention", _over_the_whole_sequence)
        assert_counted_call(wrapper, model, (), False, "attention patched", {"input_ids": ids})
        monkeypatch.undo()
        assert_counted_call(wrapper, model, (), False, "restored", {"input_ids": ids})
    assert wrapper.captures == 2


SLOT = {"at": 0}  # a setting read only to address a write: still a setting


class Addressed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.big = nn.Linear(8, 8), nn.Linear(8, 32)

    def forward(self, x):
        outs = [None, None]
        outs[SLOT["at"]] = self.fc(x)
        return outs[0] if outs[0] is not None else self.big(outs[1])


def test_a_setting_read_in_a_writes_key_is_a_setting_not_a_log():
    """``outs[SLOT["at"]] = ...`` fills ``outs``, not ``SLOT``: SLOT changed in place is another situation."""
    model = Addressed()
    wrapper = fxflops.instrument(model)
    try:
        _check(wrapper, model, False, "slot 0")
        SLOT["at"] = 1
        _check(wrapper, model, False, "slot 1: the big layer runs")
    finally:
        SLOT["at"] = 0


def test_a_function_argument_s_globals_guard_its_program():
    global TIMES
    model = Takes()
    wrapper = fxflops.instrument(model)

    def call(label):
        x = torch.randn(4, 8)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(x, _repeat_by_setting)
        assert wrapper.flops.total() == flop_counter_call(model, (x, _repeat_by_setting), {}, False), label

    try:
        call("traced")
        TIMES = 3
        call("the global the function argument reads changed")
        TIMES = 1
        call("back")
    finally:
        TIMES = 1


class Defaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, times=1, order=[0]):  # noqa: B006 - a mutable default, changed in place below
        for _ in range(times * len(order)):
            x = self.fc(x)
        return x


def test_defaults_replaced_or_changed_in_place_are_another_key():
    model = Defaults()
    wrapper = fxflops.instrument(model)
    function = Defaults.forward

    def call(label):
        x = torch.randn(4, 8)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(x)
        assert wrapper.flops.total() == flop_counter_call(model, (x,), {}, False), label

    original = function.__defaults__
    try:
        for _ in range(2):
            call("traced, then fast")
        function.__defaults__ = (2, original[1])
        call("a default replaced")
        original[1].append(1)
        function.__defaults__ = original
        call("the original defaults back, the mutable one changed in place")
        original[1].pop()
        call("and back")
    finally:
        function.__defaults__ = original
        del original[1][1:]


class Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.depth = 3

    def forward(self, x):
        for layer in self.layers[: self.depth]:
            x = layer(x)
        self.last = x  # the code keeps what it computed: never a capture's fake
        return x


class Student(nn.Module):
    """A distillation student holding its teacher unregistered (out of ``parameters()``)."""

    def __init__(self, teacher: Teacher, helper: Teacher) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.__dict__["teacher"] = teacher
        self.helpers = {"aux": helper}

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x) + self.helpers["aux"](x)
        return self.fc(x) - target


@pytest.mark.parametrize("backward", [False, True])
def test_modules_held_unregistered_are_the_programs_state_too(backward):
    teacher, helper = Teacher(), Teacher()
    model = Student(teacher, helper)
    wrapper = fxflops.instrument(model, backward=backward)
    _check(wrapper, model, backward, "traced")
    assert not isinstance(teacher.last, torch._subclasses.FakeTensor)
    changes = [
        ("the teacher's attribute", lambda: setattr(teacher, "depth", 1)),
        ("a layer appended to the teacher", lambda: (teacher.layers.append(nn.Linear(8, 8)), setattr(teacher, "depth", 4))),
        ("a teacher layer replaced by a wider one", lambda: (teacher.layers.__setitem__(0, nn.Linear(8, 16)), teacher.layers.__setitem__(1, nn.Linear(16, 8)))),
        ("the dict-held helper's attribute", lambda: setattr(helper, "depth", 2)),
        ("the dict-held helper replaced", lambda: model.helpers.__setitem__("aux", Teacher())),
        # a hook fires no registration hook: caught at the next Meter.step(), as on registered modules
        ("a hook on the teacher, then a step", lambda: (teacher.layers[2].register_forward_hook(lambda m, i, o: o @ torch.ones(8, 8)), wrapper.flops.step())),
        ("a hook on the held helper, then a step", lambda: (model.helpers["aux"].layers[0].register_forward_hook(lambda m, i, o: o @ torch.ones(8, 8)), wrapper.flops.step())),
    ]
    for label, change in changes:
        change()
        _check(wrapper, model, backward, label)


@pytest.fixture
def following_handles(monkeypatch):
    """Hook handles followed as in a fresh process (earlier tests may have made it stop)."""
    from fxflops.situation import STRUCTURE

    monkeypatch.setattr(STRUCTURE, "following_handles", True)
    monkeypatch.setattr(STRUCTURE, "useless", 0)
    return STRUCTURE


@pytest.mark.parametrize("backward", [False, True])
def test_a_hook_registered_between_calls_is_found_at_once(backward, following_handles):
    model = Knobs()
    wrapper = fxflops.instrument(model, backward=backward)
    _check(wrapper, model, backward, "traced")
    handle = model.fc.register_forward_hook(lambda m, i, o: o @ torch.ones(8, 8))
    _check(wrapper, model, backward, "a forward hook added, no step")
    pre = model.extra.register_forward_pre_hook(lambda m, args: (args[0] @ torch.ones(8, 8),))
    model.use_extra = True
    _check(wrapper, model, backward, "a pre-hook on another module and a flag")
    handle.remove()  # a removal moves no counter: found by the hook dicts' sizes, at the next call
    _check(wrapper, model, backward, "the forward hook removed, no step")
    pre.remove()
    _check(wrapper, model, backward, "the pre-hook removed, no step")
    model.fc.register_forward_hook(lambda m, i, o: o @ torch.ones(8, 8))
    _check(wrapper, model, backward, "a hook added again, no step")


def test_a_hook_removed_is_found_at_the_next_call_when_handles_are_not_followed(monkeypatch):
    from fxflops.situation import STRUCTURE

    monkeypatch.setattr(STRUCTURE, "following_handles", False)
    model = Knobs()
    handles = [model.fc.register_forward_hook(lambda m, i, o: o @ torch.ones(8, 8)) for _ in range(2)]
    wrapper = fxflops.instrument(model, backward=True)
    _check(wrapper, model, True, "two computing hooks")
    handles.pop().remove()
    _check(wrapper, model, True, "one removed")
    handles.pop().remove()
    _check(wrapper, model, True, "both removed")


def test_handles_made_on_every_call_stop_being_followed(following_handles):
    model = Knobs()
    model.fc.register_full_backward_hook(lambda m, gi, go: None)  # tensor hooks at every call
    wrapper = fxflops.instrument(model, backward=True)
    for _ in range(following_handles.USELESS_RECHECKS + 8):
        wrapper(torch.randn(5, 8)).sum().backward()
    assert not following_handles.following_handles
    assert wrapper.captures == 1
    model.extra.register_forward_hook(lambda m, i, o: o @ torch.ones(8, 8))
    model.use_extra = True  # a flag: found at once; the hook on the module it enables at the step
    wrapper.flops.step()
    _check(wrapper, model, True, "after a step")


class LazyHooks(nn.Module):
    """Registers a recording hook on its first forward, as transformers' output capturing does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if not getattr(self, "_installed", False):
            self.fc.register_forward_hook(lambda m, i, o: None)  # records nothing here, computes nothing
            self._installed = True
        return self.fc(x)


def test_hooks_the_first_real_call_installs_are_the_traced_structure(following_handles):
    model = LazyHooks()
    wrapper = fxflops.instrument(model)
    for label in ("traced", "again", "once more"):
        _check(wrapper, model, False, label)
    assert wrapper.captures == 1
    model.fc.register_forward_hook(lambda m, i, o: o @ torch.ones(8, 8))
    _check(wrapper, model, False, "a user's hook after it: found at once")
    assert wrapper.captures == 2



class Twice(nn.Linear):
    """A layer class put on a module in place (``module.__class__ = Twice``)."""

    def forward(self, x):
        return super().forward(super().forward(x))


class Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.tail = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.tail(x))


def _wrapped_forward(module):
    inner = module.forward
    module.forward = lambda x: inner(inner(x))  # an instance-level wrap, as accelerate's hooks do


@pytest.mark.parametrize("backward", [False, True])
def test_structure_changes_that_fire_no_registration_hook_guard_their_programs(backward, monkeypatch):
    """Deleting a layer from a ``ModuleList`` or a ``Sequential``, a module's class replaced in place,
    an instance-level ``forward``, a children dict written directly, a global hook removed: none of
    them fires torch's registration hooks or moves the hook handle counter (the counter is not
    followed here, as after a run of handles made in vain; the reference's own hooks would move it),
    and each makes another structure, found at the next call."""
    monkeypatch.setattr(fxflops.situation.STRUCTURE, "following_handles", False)
    model = Stacked()
    wrapper = fxflops.instrument(model, backward=backward)
    weight = torch.randn(4, 4)
    handles = []
    steps = [
        ("traced", lambda: None),
        ("a global forward hook registered", lambda: handles.append(
            nn.modules.module.register_module_forward_hook(lambda m, a, out: out @ weight if type(m) is nn.Linear and out.shape[-1] == 4 else out)
        )),
        ("del layers[1]", lambda: model.layers.__delitem__(1)),
        ("layers.pop(0)", lambda: model.layers.pop(0)),
        ("del tail[0]", lambda: model.tail.__delitem__(0)),
        ("a layer's class replaced in place", lambda: setattr(model.layers[0], "__class__", Twice)),
        ("an instance-level forward", lambda: _wrapped_forward(model.layers[-1])),
        ("the root's children dict written directly", lambda: model._modules.__setitem__("layers", nn.ModuleList([nn.Linear(8, 8)]))),
        ("the global hook removed", lambda: handles.pop().remove()),
    ]
    try:
        for label, change in steps:
            change()
            _check(wrapper, model, backward, label)
    finally:
        for handle in handles:
            handle.remove()


class SignedScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, k=0.0, window=slice(None)):
        h = self.fc(x[window])
        if math.copysign(1.0, k) < 0:  # -0.0 == 0.0, yet the code tells them apart
            h = self.fc(h)
        if k != k:  # NaN
            h = self.fc(self.fc(h))
        return h


@pytest.mark.parametrize("backward", [False, True])
def test_float_arguments_are_told_apart_by_bits_and_slices_are_counted(backward):
    """``0.0`` and ``-0.0`` are equal and hash equal, NaN equals nothing, a slice was not hashable:
    each is its own situation, by its bits (a NaN argument is one situation, not a new capture per
    call), and a slice argument's calls are counted."""
    model = SignedScale()
    wrapper = fxflops.instrument(model, backward=backward)
    x = lambda: torch.randn(6, 8)  # noqa: E731
    for label, kwargs in [
        ("0.0", {"k": 0.0}), ("-0.0", {"k": -0.0}), ("0.0 again", {"k": 0.0}), ("nan", {"k": float("nan")}),
        ("another nan", {"k": float("nan")}), ("a slice", {"window": slice(0, 3)}), ("another slice", {"window": slice(1, 6, 2)}),
    ]:
        assert_counted_call(wrapper, model, (x(),), backward, label, kwargs)
    assert wrapper.captures <= 5  # 0.0, -0.0, NaN, one per slice (its bounds are constants of the trace)


class AliasedConfig(PretrainedConfig):
    """A transformers config whose ``attribute_map`` aliases a name (as GPT-2's ``n_layer``)."""

    model_type = "fxflops_test_aliased"
    attribute_map = {"num_layers": "num_hidden_layers"}

    def __init__(self, num_hidden_layers: int = 1, **kwargs) -> None:
        self.num_hidden_layers = num_hidden_layers
        super().__init__(**kwargs)


class Settings:
    """An object serving its settings from a dict through ``__getattr__``."""

    def __init__(self) -> None:
        self._values = {"wide": False}

    def __getattr__(self, name):
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None


class KnobsBehindGetattr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config, self.settings, self.fc = AliasedConfig(), Settings(), nn.Linear(8, 8)
        self._knobs = {"twice": False}

    def __getattr__(self, name):
        knobs = self.__dict__.get("_knobs", {})
        return knobs[name] if name in knobs else super().__getattr__(name)

    def forward(self, x):
        for _ in range(self.config.num_layers):
            x = self.fc(x)
        if self.settings.wide:
            x = self.fc(x)
        return self.fc(self.fc(x)) if self.twice else x


@pytest.mark.parametrize("backward", [False, True])
def test_attributes_a_class_resolves_itself_guard_their_programs(backward):
    """A name neither the object nor its class holds, read through the class's own lookup: an alias
    of a transformers config's ``attribute_map``, a dict behind ``__getattr__`` on a held object or
    on a module. Its value is the state, read the same way per call."""
    model = KnobsBehindGetattr()
    wrapper = fxflops.instrument(model, backward=backward)
    for label, change in [
        ("traced", lambda: None),
        ("the aliased attribute changed", lambda: setattr(model.config, "num_hidden_layers", 3)),
        ("set through its alias", lambda: setattr(model.config, "num_layers", 2)),
        ("a held object's __getattr__ dict", lambda: model.settings._values.update(wide=True)),
        ("the module's __getattr__ dict", lambda: model._knobs.update(twice=True)),
        ("all back", lambda: (model.config.__setattr__("num_hidden_layers", 1), model.settings._values.update(wide=False), model._knobs.update(twice=False))),
    ]:
        change()
        _check(wrapper, model, backward, label)


class ThroughGetenv(nn.Module):
    """Reads the environment only through ``os.getenv`` (and imported by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if os.getenv("FXFLOPS_TEST_GETENV") == "1":
            h = self.fc(h)
        if getenv("FXFLOPS_TEST_GETENV_BY_NAME", "0") == "1":
            h = self.fc(h)
        return h


@pytest.mark.parametrize("backward", [False, True])
def test_environment_variables_read_with_getenv_guard_their_programs(backward, monkeypatch):
    monkeypatch.delenv("FXFLOPS_TEST_GETENV", raising=False)
    monkeypatch.delenv("FXFLOPS_TEST_GETENV_BY_NAME", raising=False)
    model = ThroughGetenv()
    wrapper = fxflops.instrument(model, backward=backward)
    for label, change in [
        ("traced", lambda: None),
        ("os.getenv", lambda: monkeypatch.setenv("FXFLOPS_TEST_GETENV", "1")),
        ("getenv imported by name", lambda: monkeypatch.setenv("FXFLOPS_TEST_GETENV_BY_NAME", "1")),
        ("both back", lambda: (monkeypatch.delenv("FXFLOPS_TEST_GETENV"), monkeypatch.delenv("FXFLOPS_TEST_GETENV_BY_NAME"))),
    ]:
        change()
        _check(wrapper, model, backward, label)


class SharedOrNot(nn.Module):
    """Branches on whether two inputs are one tensor (as attention code does for ``key is value``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, a, pair):
        h = self.fc(a)
        if pair[0] is pair[1]:
            return h + self.fc(pair[0])
        return h + self.fc(pair[0]) @ self.fc.weight + self.fc(pair[1])


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("first", ["shared", "distinct"])
def test_one_tensor_passed_in_two_places_is_another_situation(first, backward):
    """``model(a, [x, x])`` and ``model(a, [x, y])`` are counted each as it runs, whichever came first."""
    torch.manual_seed(0)
    model = SharedOrNot()
    wrapper = fxflops.instrument(model, backward=backward)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    calls = {"shared": (x, [x, x]), "distinct": (x, [x, y])}
    order = [first, *(name for name in calls if name != first), first]
    for name in order:
        assert_counted_call(wrapper, model, calls[name], backward, (first, name))
    assert wrapper.captures == 2


class _Adapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.twice = False

    def forward(self, x):
        x = self.fc(x)
        return self.fc(x) if self.twice else x


class _TakesAnAdapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, adapter=None):
        h = self.fc(x)
        return h if adapter is None else adapter(h)


@pytest.mark.parametrize("backward", [False, True])
def test_a_module_passed_in_the_call_is_counted_as_it_is_at_each_call(backward):
    """``model(x, adapter=a)``: the adapter's flag set, its layer replaced by a wider one, then set
    back: each call is counted as it runs (was the first call's count: 1024 vs 1536)."""
    torch.manual_seed(0)
    model, adapter = _TakesAnAdapter(), _Adapter()
    wrapper = fxflops.instrument(model, backward=backward)
    x = torch.randn(4, 8)

    def wider(a):  # noqa: ANN001, ANN202
        a.fc = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))

    steps = [
        ("as built", lambda a: None), ("flag set", lambda a: setattr(a, "twice", True)), ("layer replaced", wider),
        ("flag back", lambda a: setattr(a, "twice", False)),
    ]
    for label, change in steps:
        change(adapter)
        assert_counted_call(wrapper, model, (x,), backward, label, {"adapter": adapter})


class _Options:
    deep = False  # class defaults the forward reads through the instance it is passed
    repeats = (1,)

    def __init__(self) -> None:
        self.scale = 1.0


class _SlotOptions:
    __slots__ = ("scale",)
    deep = False

    def __init__(self) -> None:
        self.scale = 1.0


class _ClassFlagAdapter(nn.Module):
    twice = False  # a class default of a module passed in the call

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.fc(x)) if self.twice else self.fc(x)


class _TakesOptions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, opts, slot_opts, adapter):
        h = self.fc(x)
        if opts.deep:
            h = self.fc(h)
        for _ in range(sum(opts.repeats)):
            h = self.fc(h)
        if slot_opts.deep:
            h = self.fc(h)
        return adapter(h)


@pytest.mark.parametrize("backward", [False, True])
def test_class_defaults_of_objects_and_modules_passed_in_the_call_are_part_of_its_key(backward):
    """``model(x, opts, slot_opts, adapter)`` whose forward reads class defaults through them
    (``opts.deep`` with ``deep = False`` on the class): each changed on the class, and back, is
    counted as it runs (was the first call's count: 1536 vs 2048 forward)."""
    torch.manual_seed(0)
    model = _TakesOptions()
    wrapper = fxflops.instrument(model, backward=backward)
    x, call = torch.randn(4, 8), (_Options(), _SlotOptions(), _ClassFlagAdapter())
    steps = [
        ("as built", lambda: None), ("an object's class default", lambda: setattr(_Options, "deep", True)),
        ("a tuple class default", lambda: setattr(_Options, "repeats", (1, 2))),
        ("a slotted object's class default", lambda: setattr(_SlotOptions, "deep", True)),
        ("a module argument's class default", lambda: setattr(_ClassFlagAdapter, "twice", True)),
        ("all back", lambda: [setattr(c, n, v) for c, n, v in [
            (_Options, "deep", False), (_Options, "repeats", (1,)), (_SlotOptions, "deep", False), (_ClassFlagAdapter, "twice", False),
        ]]),
    ]
    try:
        for label, change in steps:
            change()
            for _ in range(2):  # the second call of a situation takes the generated fast check
                assert_counted_call(wrapper, model, (x, *call), backward, label)
    finally:
        _Options.deep, _Options.repeats, _SlotOptions.deep, _ClassFlagAdapter.twice = False, (1,), False, False


class _Steer:
    """A forward hook object with a flag (activation steering): when on, it adds a projection."""

    def __init__(self, fc: nn.Module) -> None:
        self.on, self.fc = False, fc

    def __call__(self, module, args, out):
        return self.fc(out) if self.on else out

    def method(self, module, args, out):
        return self.fc(out) if self.on else out


class _Bookkeeping:
    """A forward hook object that counts calls, keeps the last output and logs shapes: its own state."""

    def __init__(self) -> None:
        self.calls, self.last, self.shapes = 0, None, []

    def __call__(self, module, args, out):
        self.calls += 1
        self.last = out.detach()
        self.shapes.append(tuple(out.shape))


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("how", ["object", "bound method"])
def test_a_hook_object_s_flag_is_part_of_the_model_state(how, backward):
    """A hook registered as an object (or its bound method) whose flag the trace read: set between
    calls, the next call gets its own program (was the first one's count: 1024 vs 1536); its own
    bookkeeping (a counter it increments, the last output, a log it fills) is not a new situation,
    and a capture does not change it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    steer, books = _Steer(nn.Linear(8, 8)), _Bookkeeping()
    model[0].register_forward_hook(steer if how == "object" else steer.method)
    model[1].register_forward_hook(books)
    wrapper = fxflops.instrument(model, backward=backward)
    x = torch.randn(4, 8)
    for step, on in enumerate((False, False, True, True, False)):
        steer.on = on
        assert_counted_call(wrapper, model, (x,), backward, (how, step, on))
    assert wrapper.captures == 2
    assert books.calls == 2 * 5 and len(books.shapes) == 2 * 5  # the wrapper's calls and the references', no capture's


STEERING = False  # a module-level switch a hook object's __call__ reads


class _GloballySteered:
    def __init__(self, fc: nn.Module) -> None:
        self.fc = fc

    def __call__(self, module, args, out):
        return self.fc(out) if STEERING else out


@pytest.mark.parametrize("backward", [False, True])
def test_a_hook_object_s_code_is_walked_for_the_globals_it_reads(backward):
    """A hook registered as a callable object reads a global in ``__call__``: switched between
    calls, and back, each call is counted as it runs (was the first call's count: 1024 vs 1536)."""
    global STEERING
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[0].register_forward_hook(_GloballySteered(nn.Linear(8, 8)))
    wrapper = fxflops.instrument(model, backward=backward)
    x = torch.randn(4, 8)
    try:
        for step, on in enumerate((False, True, True, False)):
            STEERING = on
            assert_counted_call(wrapper, model, (x,), backward, (step, on))
    finally:
        STEERING = False


class _EveryOther:
    """A forward hook object that counts its calls and projects every other one (a schedule kept in
    the hook): its counter is bookkeeping and situation at once."""

    def __init__(self, fc: nn.Module) -> None:
        self.calls, self.fc = 0, fc

    def __call__(self, module, args, out):
        self.calls += 1
        return self.fc(out) if self.due() else out

    def due(self):
        return self.calls % 2 == 0


@pytest.mark.parametrize("backward", [False, True])
def test_a_hook_that_branches_on_its_own_counter_is_counted_as_it_runs(backward):
    """The counter a hook increments and also reads (in a method it calls) is compared, not taken
    for bookkeeping: odd and even calls are each counted as they run (was the first call's count
    on every call: 1024 vs 1536 forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    hook = _EveryOther(nn.Linear(8, 8))
    model[0].register_forward_hook(hook)
    wrapper = fxflops.instrument(model, backward=backward)
    x = torch.randn(4, 8)
    for step in range(4):
        _counted_then_rewound(wrapper, model, x, backward, lambda: setattr(hook, "calls", hook.calls - 1), step)


class _CountingBlock(nn.Module):
    """Keeps count of its calls and of the rows it saw: its own bookkeeping, read nowhere else."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls, self.rows = 0, 0

    def forward(self, x):
        self.calls += 1
        self.rows = self.rows + x.shape[0]
        return self.fc(x)


def _due(module) -> bool:
    return module.calls % 2 == 0


class _ReadsTheCount(nn.Module):
    """Projects every other call, by its block's counter read in its forward or in a helper."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.block, self.extra = how, _CountingBlock(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.block(x)
        due = self.block.calls % 2 == 0 if self.how == "forward" else _due(self.block)
        return self.extra(h) if due else h


@pytest.mark.parametrize("backward", [False, True])
def test_a_module_s_call_counter_is_its_bookkeeping_unless_the_code_reads_it(backward):
    """A counter a module only updates (``self.calls += 1``) is not a situation: one capture serves
    every call, and the counter counts the real calls. Read beyond its update (by the parent's
    forward, by a helper), it is: every call counted as it runs (a recapture per call)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = nn.Sequential(_CountingBlock(), nn.Linear(8, 8))
    wrapper = fxflops.instrument(model, backward=backward)
    for step in range(4):
        assert_counted_call(wrapper, model, (x,), backward, step)
    assert wrapper.captures == 1
    assert model[0].calls == 8 and model[0].rows == 32  # the wrapper's four calls and the references'
    for how in ("forward", "helper"):
        model = _ReadsTheCount(how)
        wrapper = fxflops.instrument(model, backward=backward)
        for step in range(4):
            rewind = lambda: setattr(model.block, "calls", model.block.calls - 1)  # noqa: E731
            _counted_then_rewound(wrapper, model, x, backward, rewind, (how, step))


_FUSED = contextvars.ContextVar("fused", default=False)
_LOCAL = threading.local()


class _Switched(nn.Module):
    """Reads a context variable or a thread-local flag, as a library's "use the fused path" switch."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.fc, self.extra = how, nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        on = _FUSED.get() if self.how == "context variable" else getattr(_LOCAL, "on", False)
        return self.extra(h) if on else h


def _switch(how: str, on: bool) -> None:
    if how == "context variable":
        _FUSED.set(on)
    else:
        _LOCAL.on = on


_DEFAULT_OPTIONS = types.SimpleNamespace(deep=False)
_OPTIONS_VAR = contextvars.ContextVar("options", default=_DEFAULT_OPTIONS)
_THREAD = threading.local()


class _ThroughHeldOptions(nn.Module):
    """Reads a flag on the object a context variable or a thread-local holds (``VAR.get().deep``,
    ``LOCAL.options.deep``): a per-request or per-thread settings object."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.fc = how, nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        options = _OPTIONS_VAR.get().deep if self.how == "context variable" else _THREAD.options.deep
        return self.fc(h) if options else h


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("how", ["context variable", "thread-local"])
def test_the_object_a_context_variable_or_thread_local_holds_is_part_of_the_situation(how, backward):
    """The object's flag flipped, another object set, the first one back: each call counted as it
    runs (was the first call's count: 512 vs 1024). A capture's context does not hold the caller's
    objects, so a call with another object in its context variable is measured, exactly; a
    thread's own object, in a thread of its own."""
    torch.manual_seed(0)
    model = _ThroughHeldOptions(how)
    wrapper = fxflops.instrument(model, backward=backward)
    x = torch.randn(4, 8)
    _THREAD.options = _DEFAULT_OPTIONS
    token = None

    def put(options) -> None:  # noqa: ANN001
        nonlocal token
        if how == "thread-local":
            _THREAD.options = options
        elif options is _DEFAULT_OPTIONS:
            _OPTIONS_VAR.reset(token)
        else:
            token = _OPTIONS_VAR.set(options)

    try:
        assert_counted_call(wrapper, model, (x,), backward, "default")
        _DEFAULT_OPTIONS.deep = True
        assert_counted_call(wrapper, model, (x,), backward, "default's flag set")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # measured: said once
            put(types.SimpleNamespace(deep=False))
            assert_counted_call(wrapper, model, (x,), backward, "another object")
            (_OPTIONS_VAR.get() if how == "context variable" else _THREAD.options).deep = True
            assert_counted_call(wrapper, model, (x,), backward, "another object's flag set")
        put(_DEFAULT_OPTIONS)
        _DEFAULT_OPTIONS.deep = False
        assert_counted_call(wrapper, model, (x,), backward, "default back")
        if how == "thread-local":
            setup = lambda: setattr(_THREAD, "options", types.SimpleNamespace(deep=True))  # noqa: E731
            counted, reference = _counted_in_another_thread(wrapper, model, x, backward, setup)
            assert counted == reference
            assert_counted_call(wrapper, model, (x,), backward, "this thread's again")
    finally:
        _DEFAULT_OPTIONS.deep = False
        _THREAD.options = _DEFAULT_OPTIONS


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("how", ["context variable", "thread-local"])
def test_a_context_variable_or_thread_local_flag_the_code_reads_is_part_of_the_situation(how, first, backward):
    """Set before the first call (the capture sees it as the call does: was traced unset, 512 vs
    1024), then switched, then back: each call counted as it runs; in another thread, that thread's
    own value."""
    torch.manual_seed(0)
    model = _Switched(how)
    wrapper = fxflops.instrument(model, backward=backward)
    x = torch.randn(4, 8)
    try:
        for on in (first, not first, first):
            _switch(how, on)
            assert_counted_call(wrapper, model, (x,), backward, (how, on))
        assert wrapper.captures == 2
        counted, reference = _counted_in_another_thread(wrapper, model, x, backward)  # the default / no attribute: off
        assert counted == reference  # the thread's own flag (off), whatever the main thread's is
        _switch(how, float("nan"))  # a NaN flag (never equal to itself) is one situation, not one per call
        before = wrapper.captures
        for _ in range(3):
            assert_counted_call(wrapper, model, (x,), backward, (how, "nan"))
        assert wrapper.captures == before + 1
    finally:
        _switch(how, False)


class _MeasuredRoot(nn.Module):
    """Its root reads a value (measured there) and multiplies in its own code (measured backward hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 16), nn.Linear(16, 16)
        self.mix = nn.Parameter(torch.eye(16))

    def forward(self, x):
        rows = int((x[:, 0] > -10).sum())  # every row: a value read, the capture fails at the root
        return self.out(self.fc(x[:rows]) @ self.mix)


@pytest.mark.parametrize("kind", ["symbolic", "measured"])
def test_a_hook_added_after_many_training_calls_is_another_situation(kind, monkeypatch):
    """fxflops' own hook handles made on every training call (the backward bill's; a measured call's
    backward hooks) do not count as handles made elsewhere: after more training calls than
    ``USELESS_RECHECKS``, handles are still followed, so a hook added then is seen at the next call
    (was: the traced count until ``flops.step()``)."""
    from fxflops.situation import STRUCTURE

    monkeypatch.setattr(STRUCTURE, "useless", 0)  # as in a fresh process (other tests' handles)
    monkeypatch.setattr(STRUCTURE, "following_handles", True)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)) if kind == "symbolic" else _MeasuredRoot()
    wrapper = fxflops.instrument(model, backward=True)
    x = torch.randn(4, 16)
    for _ in range(STRUCTURE.USELESS_RECHECKS + 6):
        wrapper(x).sum().backward()
    assert STRUCTURE.following_handles and bool(wrapper.measured) == (kind == "measured")
    first = model[0] if kind == "symbolic" else model.fc
    first.register_forward_hook(lambda module, args, out: out @ torch.eye(16))  # a probe doing a product
    assert_counted_call(wrapper, model, (x,), True, "a hook added")


def _conv_twice(x, weight, bias=None, *args):  # a patched convolution: one more per call
    return _TORCH_CONV(x, weight, bias, *args) + _TORCH_CONV(x, weight, None, *args)


_TORCH_CONV = nn.functional.conv2d


class _TorchLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 8)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


@pytest.mark.parametrize("backward", [False, True])
def test_a_torch_function_patched_under_torchs_own_layers_is_another_situation(backward, monkeypatch):
    """``nn.Linear.forward`` calls ``F.linear``, ``nn.Conv2d``'s ``_conv_forward`` ``F.conv2d``:
    patched in torch's module (a low-rank adapter), every such layer runs other work (was: the
    traced count, 4096 vs 6144 FLOPs)."""
    model = _TorchLayers()
    wrapper = fxflops.instrument(model, backward=backward)
    x = torch.randn(2, 3, 8, 8)
    assert_counted_call(wrapper, model, (x,), backward, "traced")
    monkeypatch.setattr(nn.functional, "linear", _with_adapter)
    assert_counted_call(wrapper, model, (x,), backward, "F.linear patched")
    monkeypatch.setattr(nn.functional, "conv2d", _conv_twice)
    assert_counted_call(wrapper, model, (x,), backward, "F.conv2d patched too")
    monkeypatch.undo()
    assert_counted_call(wrapper, model, (x,), backward, "restored")
    assert wrapper.captures == 3


def _light(h):
    return torch.relu(h)


def _heavy(h):
    return torch.relu(h) @ torch.eye(h.shape[-1])


ACTIVATIONS = {"act": _light, "scale": 1}  # a table of functions by name (transformers' ACT2FN style)


class _ActivationByName(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return ACTIVATIONS["act"](self.fc(x))


def test_an_entry_replaced_in_a_module_level_table_of_functions_is_another_situation(monkeypatch):
    """A module-level dict of functions the code reads an entry of: one replaced runs other work
    (was: compared by its number of entries, 2048 vs 4096 FLOPs)."""
    model = _ActivationByName()
    wrapper = fxflops.instrument(model)
    x = torch.randn(4, 16)
    assert_counted_call(wrapper, model, (x,), False, "traced")
    monkeypatch.setitem(ACTIVATIONS, "act", _heavy)
    assert_counted_call(wrapper, model, (x,), False, "the entry replaced")
    monkeypatch.undo()
    assert_counted_call(wrapper, model, (x,), False, "restored")
    assert wrapper.captures == 2
