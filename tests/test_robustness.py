"""Telemetry never breaks training and never touches the user's objects (issue 13, points 3-7).

- Fault injection: an exception raised inside each stage fxflops runs during a call (adapter prepare,
  call key, the call key test of a known situation, modes, model state, capture, analysis, binding, metadata, guard evaluation, monomials,
  routing probes, meter add) leaves the model's output and gradients exactly as without fxflops,
  marks the call uncounted with one warning, and reaches the caller only with ``strict=True``.
- A refused call layout costs one capture attempt, not one per call.
- A capture leaves a key-value cache passed to the model, and the model's own attributes, as they
  were; no fake tensor reaches an output.
- Threads: a model (plain or compiled) used in another thread during a capture sees none of the
  capture's patches; the very model being captured, seen from another thread mid-trace, keeps its
  real weights, attributes and config (the trace runs on a twin); two threads making the first call
  both count exactly.
- ``torch.save``/``torch.load``, ``copy.deepcopy`` and ``pickle`` of wrappers and programs.
- ``fxflops.ops.varlen_attention`` forward and backward under FlopCounterMode.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import pickle
import queue
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import FlopCounterMode

import fxflops
import fxflops.binder
import fxflops.build
import fxflops.call_keys
import fxflops.meter
import fxflops.program
import fxflops.routing
import fxflops.situation
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT
from reference import flop_counter_call

INSTRUMENT = sys.modules["fxflops.instrument"]  # the module (``fxflops.instrument`` is the function)
CONFIG = GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=2)
MOE = GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=2, experts=4, top_k=2, expert_ffn=16, dispatch="grouped")


def _raise(*args, **kwargs):
    raise RuntimeError("injected fault")


def _step(model, ids):
    """Output and gradients of one training step."""
    model.zero_grad(set_to_none=True)
    out = model(ids)
    out.float().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


STAGES = {  # stage -> (what to patch, attribute) ; "first" faults need no program yet, the others one
    "prepare": ("adapter", "prepare"),
    "call key": (fxflops.call_keys, "argument_key"),
    "call key test": (fxflops.call_keys.CallKeys, "check"),
    "modes": (INSTRUMENT, "mode_key"),
    "capture": (fxflops.build, "capture"),
    "analysis": (fxflops.program.Program, "from_capture"),
    "model state": (fxflops.situation.ModelState, "matches"),
    "binding": (fxflops.binder.Binder, "values"),
    "guard evaluation": ("program", "within_guards"),
    "monomials": ("program", "monomials"),
    "meter add": (fxflops.meter.Meter, "add"),
}
NEEDS_PROGRAM = {"call key test", "model state", "binding", "guard evaluation", "monomials", "meter add"}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_in_any_stage_leaves_the_step_untouched(stage, monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    plain = copy.deepcopy(model)
    wrapper = fxflops.instrument(model, backward=True)
    strict = fxflops.instrument(model, backward=True, strict=True)
    ids, other = torch.randint(0, 100, (2, 9)), torch.randint(0, 100, (3, 7))
    if stage in NEEDS_PROGRAM:  # a program exists: the fault hits a later call
        _step(wrapper, ids)
        _step(strict, ids)
    owner, name = STAGES[stage]
    for w in (wrapper, strict):
        monkeypatch.setattr({"adapter": w._adapter, "program": w.program}.get(owner, owner), name, _raise)
    uncounted = wrapper.flops.uncounted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads = _step(wrapper, other)
    expected_out, expected_grads = _step(plain, other)
    assert torch.equal(out, expected_out)
    assert grads.keys() == expected_grads.keys() and all(torch.equal(grads[k], expected_grads[k]) for k in grads)
    assert any("injected fault" in str(w.message) for w in caught), stage
    if stage == "prepare":  # the call goes on as given, which the identity adapter would not change
        assert wrapper.flops.uncounted == uncounted and wrapper.flops.total() > 0
    else:
        assert wrapper.flops.uncounted == uncounted + 1, stage
    with pytest.raises(RuntimeError, match="injected fault"):
        strict(other)


def test_a_fault_in_the_backward_bill_leaves_the_backward_untouched(monkeypatch):
    """A fault in the hook that bills a call's backward, where it asks which pass runs or registers
    it: the backward and the gradients are the plain model's, that pass is one uncounted call (the
    forward is counted), and the next step is counted whole (was: a fault asking for the pass raised
    NameError into the user's backward)."""
    import fxflops.backward

    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    plain = copy.deepcopy(model)
    wrapper = fxflops.instrument(model, backward=True)
    ids = torch.randint(0, 100, (2, 9))
    _step(wrapper, ids)
    expected_out, expected_grads = _step(plain, ids)
    for owner, name in ((fxflops.backward, "leaves_skipped"), (fxflops.backward, "_graph_task")):
        monkeypatch.setattr(owner, name, _raise)
        wrapper.flops.reset()
        out, grads = _step(wrapper, ids)
        monkeypatch.undo()
        assert torch.equal(out, expected_out) and all(torch.equal(grads[k], expected_grads[k]) for k in expected_grads)
        assert wrapper.flops.uncounted == 1 and wrapper.flops.total() == wrapper.flops.total(phase="fwd") > 0, name
    wrapper.flops.reset()
    _step(wrapper, ids)
    assert wrapper.flops.uncounted == 0 and wrapper.flops.total(phase="bwd") > 0


def test_a_fault_in_a_routing_probe_never_reaches_the_model(monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT(MOE)
    plain = copy.deepcopy(model)
    wrapper = fxflops.instrument(model, backward=True, measure_routing=True)
    ids = torch.randint(0, 100, (2, 9))
    _step(wrapper, ids)
    monkeypatch.setattr(fxflops.routing, "dispatched_flops", _raise)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads = _step(wrapper, ids)
    expected_out, expected_grads = _step(plain, ids)
    assert torch.equal(out, expected_out) and all(torch.equal(grads[k], expected_grads[k]) for k in grads)
    assert any("routing not measured" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="routing of every call measured"):  # actual refuses, model counts
        wrapper.flops.total(convention=fxflops.conventions.FLOPCOUNTER.but(moe="actual"))
    assert wrapper.flops.total() > 0


def test_a_metadata_fault_leaves_the_vlm_step_untouched(monkeypatch):
    import random

    from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch

    torch.manual_seed(0)
    model = TinyVLM()
    plain = copy.deepcopy(model)
    wrapper = fxflops.instrument(model)
    rng = random.Random(0)
    with torch.no_grad():
        wrapper(*random_batch(VLMConfig(), rng).inputs())
        program = wrapper.program
        monkeypatch.setattr(program.binder, "host_metadata", None)  # reading metadata now fails
        monkeypatch.setattr(torch.Tensor, "is_cpu", property(_raise))
        batch = random_batch(VLMConfig(), rng).inputs()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            out = wrapper(*batch)
        monkeypatch.undo()
        assert torch.equal(out, plain(*batch))
    assert wrapper.flops.uncounted == 1


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        keep = int((x > 0).sum())  # reads tensor data: no symbolic trace can say this
        return self.fc(x[:keep])


def test_a_refused_layout_costs_one_attempt(monkeypatch):
    model = DataDependent()
    wrapper = fxflops.instrument(model, measure=False)  # symbolic only: the refusal is kept
    attempts = []
    original = fxflops.build.capture
    monkeypatch.setattr(fxflops.build, "capture", lambda *a, **k: attempts.append(1) or original(*a, **k))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for rows in (5, 9, 13, 3, 7, 21, 2):
            wrapper(torch.randn(rows, 4))
        assert len(attempts) == 1 and wrapper.flops.uncounted == 7
        wrapper(torch.randn(1, 4))  # size 1 can take another path in a trace: one more attempt
        wrapper(torch.randn(1, 4))
        assert len(attempts) == 2
        wrapper(torch.randn(0, 4))  # another size class again, the last attempt this layout gets
        for rows in (0, 1, 4, 6):
            wrapper(torch.randn(rows, 4))
            wrapper(torch.randn(rows + 1, 4))
    assert len(attempts) == INSTRUMENT.MAX_ATTEMPTS
    assert wrapper.flops.uncounted == 18
    assert len({str(w.message) for w in caught}) <= 3  # warned once per distinct reason


def test_a_measured_layout_costs_one_attempt_for_every_size(monkeypatch):
    """With measured islands (the default) the failed capture's spine serves every size class:
    one attempt, every call counted (the root's own code measured, ``fc`` by its own program)."""
    model = DataDependent()
    wrapper = fxflops.instrument(model, strict=True)
    attempts = []
    original = fxflops.build.capture
    monkeypatch.setattr(fxflops.build, "capture", lambda *a, **k: attempts.append(1) or original(*a, **k))
    expected = 0
    with torch.no_grad():
        for rows in (5, 9, 1, 0, 3, 1, 21):
            x = torch.randn(rows, 4)
            wrapper(x)
            expected += 2 * min(int((x > 0).sum()), rows) * 4 * 4  # fc on the rows kept
    assert wrapper.flops.total() == expected and wrapper.flops.uncounted == 0
    assert sum(branch.attempts for branch in wrapper._branches.values()) == 1
    assert len(attempts) - 1 <= 3  # fc's own programs: size classes 2+, 1 and 0 at most


def test_a_capture_leaves_the_models_attributes_as_they_were():
    class Remembering(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.calls = 0
            self.last = None
            self.history: list = []

        def forward(self, x):
            self.calls += 1
            y = self.fc(x)
            self.last = y
            self.history.append(y.shape[0])
            return y

    model = Remembering()
    wrapper = fxflops.instrument(model)
    with torch.no_grad():
        out = wrapper(torch.randn(3, 4))
    assert model.calls == 1 and model.history == [3]  # the real call only
    assert not isinstance(model.last, FakeTensor) and torch.equal(model.last, out)
    assert wrapper.flops.total() == 2 * 3 * 4 * 4


def test_a_capture_leaves_a_kv_cache_untouched():
    transformers = pytest.importorskip("transformers") if False else __import__("transformers")
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    wrapper = fxflops.instrument(model)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        cache = transformers.DynamicCache(config=config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = wrapper(input_ids=ids, past_key_values=cache, use_cache=True)
        reference_cache = transformers.DynamicCache(config=config)
        expected = model(input_ids=ids, past_key_values=reference_cache, use_cache=True)
    assert not isinstance(out.logits, FakeTensor) and torch.equal(out.logits, expected.logits)
    assert cache.get_seq_length() == reference_cache.get_seq_length() == 6
    for layer, reference in zip(cache.layers, reference_cache.layers):
        assert not isinstance(layer.keys, FakeTensor) and torch.equal(layer.keys, reference.keys)
        assert torch.equal(layer.values, reference.values)


@contextlib.contextmanager
def _repeating_in_another_thread(step):
    """For the block, ``step()`` runs over and over in another thread; yields the list of its
    failures (``repr`` of the first exception, after which the thread stops)."""
    stop, failures = threading.Event(), []

    def loop():
        while not stop.is_set():
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - reported by the caller
                failures.append(repr(exc))
                return

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        yield failures
    finally:
        stop.set()
        worker.join()


def test_a_model_in_another_thread_sees_none_of_the_capture():
    """While another thread captures VLMs (packed pieces, layout-oblivious copies, checkpoint tags,
    read recording, FX's tracing flag), plain tensor code here behaves exactly as always."""
    from fxflops.models import hf_zoo

    import random

    x = torch.arange(12.0).reshape(4, 3)

    def plain_work():
        assert [t.shape[0] for t in torch.split(x, [1, 3])] == [1, 3]
        assert [t.tolist() for t in x.split([2, 2])] == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]]
        assert len(list(x)) == 4 and len(x) == 4
        assert x.contiguous() is x and x.t().contiguous().is_contiguous()
        assert torch.tensor([[1, 2], [3, 4]]).tolist() == [[1, 2], [3, 4]]
        with pytest.raises(RuntimeError, match="single memory location"):
            torch.zeros(1, 3).expand(4, 3).add_(1)  # the in-place overlap check still holds
        assert F.linear(x, torch.eye(3)).equal(x)
        assert not torch.fx._symbolic_trace.is_fx_tracing()

    with _repeating_in_another_thread(plain_work) as failures:
        model = hf_zoo.build("qwen2_vl", "sdpa")
        wrapper = fxflops.instrument(model, backward=True, strict=True)
        rng = random.Random(0)
        for images in (1, 2, 0):
            wrapper(**hf_zoo.random_batch("qwen2_vl", rng, images=images)).loss.backward()
        assert wrapper.captures >= 2
    assert not failures, failures


def test_a_compiled_module_in_another_thread_keeps_running_during_a_capture():
    """FX's process-wide tracing flag no longer reaches another thread: its compiled module runs
    (it raised "FX to symbolically trace a dynamo-optimized function" before), waiting while the
    capture traces (running, it disturbed the trace: a silently lower count), and the capture counts
    its call exactly."""
    calls = [0]
    compiled = torch.compile(torch.nn.Linear(3, 3), backend="eager")
    x = torch.zeros(4, 3)
    compiled(x)  # compiled before the capture starts

    def compiled_work():
        assert compiled(x).shape == (4, 3)
        calls[0] += 1

    with _repeating_in_another_thread(compiled_work) as failures:
        torch.manual_seed(0)
        model = TinyGPT(CONFIG)
        wrapper = fxflops.instrument(model, backward=True)
        ids = torch.randint(0, 100, (2, 9))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapper(ids).sum().backward()
    assert not failures and calls[0] > 0, failures
    assert wrapper.flops.total() == flop_counter_call(model, (ids,), {}, backward=True)
    assert wrapper.flops.uncounted == 0


def _module_states(model):
    """Every module's attributes (by identity) and its parameters', buffers' and children's dicts."""
    return [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()]


def _states_equal(now, before) -> bool:
    return all(
        all(a.get(k, None) is v for k, v in b.items()) and a.keys() == b.keys()
        for (_, *now_dicts), (_, *before_dicts) in zip(now, before)
        for a, b in zip(now_dicts, before_dicts)
    )


@pytest.mark.long  # ~30 s of captures beside a busy thread; the deterministic test below is in the default suite
def test_the_same_model_in_another_thread_runs_on_its_own_weights_during_captures():
    """A capture traces a twin of the module tree: another thread running the very model meanwhile
    (an evaluation thread) computes with the real weights, never a fake one, and every module's
    attributes stay the objects they were, also while the capture runs."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    probe = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        expected = model(probe)
    before = _module_states(model)
    seen = [0]

    def evaluate():
        with torch.no_grad():
            out = model(probe)
        assert not isinstance(out, FakeTensor) and torch.equal(out, expected)
        assert not any(isinstance(p, FakeTensor) for p in model.parameters())
        assert _states_equal(_module_states(model), before), "a module's attributes changed during a capture"
        seen[0] += 1

    wrapper = fxflops.instrument(model, backward=True, strict=True)
    with _repeating_in_another_thread(evaluate) as failures:
        for shape in ((2, 9), (3, 4)):
            ids = torch.randint(0, 100, shape)
            wrapper(ids).sum().backward()
            with torch.no_grad():
                wrapper(ids)
    assert not failures, failures
    assert seen[0] > 0 and wrapper.captures >= 2

@dataclasses.dataclass
class _Settings:
    length: int = 0


_WHILE_TRACED: list = []  # what _WritesWhileTraced calls while traced: outside the model, so it sees the user's model


class _WritesWhileTraced(nn.Module):
    """Writes to itself and to the config it holds in forward; while traced (symbolic sizes), it lets
    the function in ``_WHILE_TRACED`` look at the model from another thread at that very moment (a
    function the model held would be the twin's: a closure over the model's modules is rebound to
    their copies, capture/isolation.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.config, self.proj = _Settings(), nn.Linear(4, 4)

    def forward(self, x):
        self.config.length = x.shape[0]
        self.last_input = x
        if not isinstance(x.shape[0], int):  # inside a capture's trace
            _WHILE_TRACED[0]()
        return self.proj(x)


def test_while_a_capture_traces_the_users_model_and_config_are_untouched():
    """At the moment the trace has written to the model and its config, and the capture has put fake
    parameters in: the user's model, seen from another thread, still holds its real weights and
    its own attributes, and its config is as it was. (What the other thread sees goes to a queue: a
    list the model's code reaches is put back after the capture, capture/side_effects.py.)"""
    seen: queue.Queue[str] = queue.Queue()

    def inspect():
        def look():
            weight = model.proj._parameters["weight"]
            for line in (
                f"fake weight: {isinstance(weight, FakeTensor)}",
                f"weight is the parameter: {weight is real_weight}",
                f"config length: {model.config.length}",
                f"last input kept: {'last_input' in vars(model)}",
            ):
                seen.put(line)

        worker = threading.Thread(target=look)
        worker.start()
        worker.join(timeout=10)

    model = _WritesWhileTraced()
    real_weight = model.proj.weight
    wrapper = fxflops.instrument(model, strict=True)
    x = torch.randn(6, 4)
    _WHILE_TRACED[:] = [inspect]
    try:
        assert torch.equal(wrapper(x), model.proj(x))
    finally:
        _WHILE_TRACED.clear()
    assert list(seen.queue) == ["fake weight: False", "weight is the parameter: True", "config length: 0", "last input kept: False"]
    assert wrapper.flops.total() == 2 * 6 * 4 * 4

@pytest.mark.parametrize("shared", [False, True], ids=["two_wrappers", "one_wrapper"])
def test_two_threads_making_the_first_call_both_count_exactly(shared):
    torch.manual_seed(0)
    models = [TinyGPT(CONFIG) for _ in range(2)]
    wrappers = [fxflops.instrument(m, backward=True, strict=True) for m in models]
    if shared:
        models, wrappers = [models[0]] * 2, [wrappers[0]] * 2
    inputs = [torch.randint(0, 100, (2, 9)), torch.randint(0, 100, (3, 5))]
    errors: list[str] = []
    barrier = threading.Barrier(2)

    def first_call(i: int) -> None:
        try:
            barrier.wait()
            wrappers[i](inputs[i]).sum().backward()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expected = [flop_counter_call(models[i], (inputs[i],), {}, backward=True) for i in range(2)]
    if shared:
        assert wrappers[0].flops.total() == sum(expected) and wrappers[0].captures == 1
    else:
        assert [w.flops.total() for w in wrappers] == expected


def _training_count(wrapper, ids) -> int:
    wrapper.flops.reset()
    wrapper(ids).sum().backward()
    return wrapper.flops.total()


def test_save_load_deepcopy_and_pickle_count_exactly():
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    ids = torch.randint(0, 100, (2, 9))
    _training_count(wrapper, ids)
    buffer = io.BytesIO()
    torch.save(wrapper, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(wrapper)
    other = torch.randint(0, 100, (4, 13))
    for twin in (loaded, copied):
        assert _training_count(twin, other) == flop_counter_call(twin.wrapped_model, (other,), {}, backward=True)
        assert twin.captures == 1  # the loaded program serves the new model: no re-capture
        assert twin.wrapped_model is not model and twin._parameters is twin.wrapped_model._parameters
    program = pickle.loads(pickle.dumps(wrapper.program))
    expected = flop_counter_call(model, (other,), {}, backward=True)
    assert program.count(other) == expected
    assert program.total(input_ids_0=4, input_ids_1=13) == expected
    assert _training_count(wrapper, other) == expected  # the original is unaffected


class _NamedLikeTheWrapper(nn.Module):
    """Children named as a wrapper's own settings once were (``adapter``, ``prefix``, ``routing``)
    and as a Hugging Face model's inner ``model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.adapter = nn.Linear(8, 8), nn.Linear(8, 8)
        self.prefix, self.routing = nn.Linear(8, 8), nn.Linear(8, 8)
        self.backward = "a plain attribute"

    def forward(self, x):
        return self.routing(self.prefix(self.adapter(self.model(x))))


def test_a_model_whose_children_have_the_wrapper_s_setting_names_is_instrumented():
    """``instrument`` raised TypeError on a child named ``adapter`` or ``prefix``, and
    ``wrapper.model`` was the wrapped model, not its child: now every name is the model's, through
    the wrapper as through the model, also after a save and load (and from a wrapper pickled
    before the settings were private)."""
    model = _NamedLikeTheWrapper()
    wrapper = fxflops.instrument(model, backward=True)
    for name in ("model", "adapter", "prefix", "routing", "backward"):
        assert getattr(wrapper, name) is getattr(model, name), name
    assert wrapper.wrapped_model is model
    x = torch.randn(4, 8)
    assert _training_count(wrapper, x) == flop_counter_call(model, (x,), {}, backward=True)
    loaded = pickle.loads(pickle.dumps(wrapper))
    assert loaded.adapter is loaded.wrapped_model.adapter and loaded.wrapped_model is not model
    assert _training_count(loaded, x) == flop_counter_call(loaded.wrapped_model, (x,), {}, backward=True)
    state = {name[1:] if name in ("_model", "_traced", "_adapter", "_backward", "_prefix") else name: value
             for name, value in wrapper.__getstate__().items()}
    old = type(wrapper).__new__(type(wrapper))
    old.__setstate__(state)
    assert old.wrapped_model is model and old.prefix is model.prefix
    assert _training_count(old, x) == flop_counter_call(model, (x,), {}, backward=True)


class _Repeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.repeats = nn.Linear(8, 8), 1

    def forward(self, x):
        for _ in range(self.repeats):
            x = self.fc(x)
        return x


@pytest.mark.parametrize("copied", [False, True])
def test_an_attribute_set_on_the_wrapper_is_set_on_the_model(copied):
    """A setting a training script sets on the model handle it holds, the wrapper
    (``wrapper.gradient_checkpointing = True``), is the model's: its code reads it, and the call is
    counted as it runs (was: set on the wrapper only, the model ran and was counted as before);
    deleted from the model too; the wrapper's own settings and meter stay its own."""
    wrapper = fxflops.instrument(_Repeated(), backward=True)
    if copied:
        wrapper = pickle.loads(pickle.dumps(wrapper))
    model, x = wrapper.wrapped_model, torch.randn(4, 8)
    once = _training_count(wrapper, x)
    assert once == flop_counter_call(model, (x,), {}, backward=True)
    wrapper.repeats = 3
    assert model.repeats == 3 and "repeats" not in vars(wrapper)
    assert _training_count(wrapper, x) == flop_counter_call(model, (x,), {}, backward=True) > once
    del wrapper.repeats
    assert not hasattr(model, "repeats")
    wrapper.extra = nn.Linear(8, 8)  # a child, as before
    assert model.extra is wrapper.extra
    meter = fxflops.Meter()
    wrapper.flops = meter
    wrapper.train(False)
    assert wrapper.flops is meter and not hasattr(model, "flops") and not model.training


def test_varlen_attention_forward_and_backward_under_flop_counter_mode():
    torch.manual_seed(0)
    q = torch.randn(10, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(10, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    offsets, g = torch.tensor([0, 3, 10]), torch.randn(10, 4, 8, dtype=torch.float64)
    for causal in (False, True):
        with FlopCounterMode(display=False):
            fxflops.ops.varlen_attention(q, k, v, offsets, offsets, causal=causal).backward(g)
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        parts = []
        for a, b in ((0, 3), (3, 10)):
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)[0].transpose(0, 1))
        torch.cat(parts).backward(g)
        assert all(torch.allclose(a, t.grad) for a, t in zip(grads, (q, k, v)))
        for t in (q, k, v):
            t.grad = None


def test_import_fxflops_makes_ops_available():
    code = "import fxflops; print(type(fxflops.ops.varlen_attention).__name__)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "CustomOpDef"
