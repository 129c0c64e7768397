"""A capture never changes what the user holds: hooks and modes around the call, objects the model's
code writes to, arguments, tensors, random streams (``fxflops/capture/ambient.py``,
``isolation.py``, ``side_effects.py``, ``randomness.py``).

Each test runs the same calls through ``instrument()`` and through an uninstrumented copy of the
model, and compares what the user sees afterwards (outputs, lists and counters their hooks fill,
caches, argument objects, tensor attributes, random states) with the plain run's, and every count
with FlopCounterMode on the same call (``reference.flop_counter_call``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import queue
import random
import subprocess
import sys
import textwrap
import threading
import warnings
from random import random as _coin

import numpy as np
import pytest
import torch
import torch.nn.modules.module as module_module
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from reference import flop_counter_call, training_reference_total


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _step(model, x, backward):
    out = model(x)
    if backward:
        out.sum().backward()
    return out


def _fake(value) -> bool:
    return isinstance(value, (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool))


# 1. the user's saved-tensor hooks and modes never see the capture ----------------------------------

_IN_USER_CONTEXTS = textwrap.dedent("""
    import sys, warnings
    import torch
    from torch.utils.checkpoint import checkpoint
    import fxflops
    sys.path.insert(0, {tests!r})
    from test_capture_isolation import MLP
    from reference import flop_counter_call

    def run(model, context):
        x = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(1))
        packs = [0, 0]
        def pack(t):
            packs[0] += 1
            return t
        def unpack(t):
            packs[1] += 1
            return t
        if context == "checkpoint":
            out = checkpoint(model, x, use_reentrant=False)
        elif context == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                out = model(x)
        else:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = model(x)
        out.sum().backward()
        return x.grad, packs

    warnings.simplefilter("ignore")
    for context in ("checkpoint", "save_on_cpu", "hooks"):
        torch.manual_seed(0)
        model = MLP()
        plain = MLP()
        plain.load_state_dict(model.state_dict())
        wrapper = fxflops.instrument(model, backward=True)
        grad, packs = run(wrapper, context)
        expected_grad, expected_packs = run(plain, context)
        assert torch.equal(grad, expected_grad), context
        assert packs == expected_packs, (context, packs, expected_packs)
        # the checkpoint's recompute of the wrapper, stopped early by torch, is uncounted (test_training.py)
        assert wrapper.flops.uncounted == (context == "checkpoint") and wrapper.captures == 1, context
        if context != "checkpoint":
            x = torch.randn(4, 8, requires_grad=True)
            assert wrapper.flops.total() == flop_counter_call(plain, (x,), {{}}, backward=True), context
    print("DONE")
""")


def test_a_first_call_inside_the_users_checkpoint_or_saved_tensor_hooks_completes():
    """A first (capturing) call inside a non-reentrant checkpoint (it re-entered the wrapper from the
    traced backward's unpack hook: a deadlock), save_on_cpu or the user's own pack hooks: it
    completes (in a subprocess with a time limit: a regression fails, it does not hang the suite),
    with the plain model's gradients and pack/unpack counts, and counts exactly."""
    code = _IN_USER_CONTEXTS.format(tests=str(__import__("pathlib").Path(__file__).parent))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a first call inside the user's checkpoint or saved-tensor hooks hung")
    assert "DONE" in done.stdout, done.stdout + done.stderr[-3000:]


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _SeesFakes(TorchFunctionMode):
    """Records whether any torch function it sees gets a fake tensor or a symbolic size."""

    def __init__(self) -> None:
        super().__init__()
        self.fakes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.fakes += any(_fake(v) for v in torch.utils._pytree.tree_leaves((args, kwargs)))
        return func(*args, **kwargs)


def _counts_by_module(target, x, backward) -> dict:
    counter = FlopCounterMode(display=False)
    with counter:
        _quietly(_step, target, x.detach().requires_grad_(backward), backward)
    return counter.get_flop_counts()


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "training"])
def test_the_users_modes_see_only_the_real_call(backward):
    """A logging dispatch mode and a function mode around a first call see the call's own ops only
    (the plain model's aten ops, none of the capture's fakes); the user's FlopCounterMode around a
    first call counts it (plain ints, by module) as it counts a later call, which captures nothing."""
    torch.manual_seed(0)
    model = MLP()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=backward)
    logs = {}
    for name, target in (("wrapper", fxflops.instrument(model, backward=backward)), ("plain", plain)):
        log, functions = _OpLog(), _SeesFakes()
        with functions, log:
            _quietly(_step, target, x.detach().requires_grad_(backward), backward)
        logs[name] = sorted(log.ops)
        assert functions.fakes == 0, name
    assert logs["wrapper"] == logs["plain"]
    wrapper = fxflops.instrument(model, backward=backward)
    first = _counts_by_module(wrapper, x, backward)
    assert first == _counts_by_module(wrapper, x, backward)
    assert all(type(n) is int for per_op in first.values() for n in per_op.values())
    total = flop_counter_call(plain, (x,), {}, backward=backward)
    assert sum(first["Global"].values()) == total
    wrapper.flops.reset()
    _quietly(_step, wrapper, x.detach().requires_grad_(backward), backward)
    assert wrapper.flops.total() == total
    assert wrapper.captures == 1 and wrapper.measured == {}


# 2. what the hooks write ---------------------------------------------------------------------------

_GLOBAL_CALLS = 0
_GLOBAL_RECORDS: dict[str, list] = {"outputs": []}
_PROJECTION = torch.randn(8, 8)


def _count_globally(module, inputs, output):
    global _GLOBAL_CALLS
    _GLOBAL_CALLS += 1
    _GLOBAL_RECORDS["outputs"].append(output)


class _Recorder:
    """A bound-method hook's object: a counter and a list of what it saw."""

    def __init__(self) -> None:
        self.calls = 0
        self.shapes: list = []
        self.means: list = []

    def hook(self, module, inputs, output):
        self.calls += 1
        self.shapes.append(output.shape[0])
        self.means.append(output.abs().mean().item())


def _into(records, module, inputs):
    records.append(inputs[0])


def _hooked(records: dict, recorder: _Recorder) -> tuple[nn.Module, list]:
    """An MLP whose modules' hooks record into ``records``, ``recorder`` and this module's globals;
    returns the model and the removable handles."""
    torch.manual_seed(0)
    model = MLP()
    calls = 0

    def count(module, inputs, output):
        nonlocal calls
        calls += 1
        records["calls"] = calls

    def project(module, inputs):  # a pre-hook that computes: its FLOPs count
        return (inputs[0] @ _PROJECTION,)

    handles = [
        model.fc1.register_forward_hook(lambda m, i, o: records["forward"].append(o)),
        model.fc1.register_forward_hook(count),
        model.fc1.register_forward_pre_hook(project),
        model.fc2.register_forward_pre_hook(functools.partial(_into, records["pre"])),
        model.fc2.register_full_backward_hook(lambda m, gi, go: records["backward"].append(go[0])),
        model.fc2.register_forward_hook(recorder.hook),
        model.fc2.register_forward_hook(_count_globally),
        module_module.register_module_forward_hook(
            lambda m, i, o: records["global"].append(o.shape) if isinstance(m, nn.Linear) else None
        ),
    ]
    return model, handles


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "training"])
def test_hooks_record_what_they_record_for_the_plain_model(backward):
    """Forward, pre-forward, full backward and global hooks, recording into closed-over lists and
    dicts, a ``nonlocal`` counter, a bound method's object, a ``functools.partial``'s list and
    module globals: after the first call each holds what the plain model's call leaves (no fake,
    no symbolic number, nothing twice), and the count (a pre-hook's matmul included) is exact."""
    global _GLOBAL_CALLS
    seen = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=backward)
    for label in ("reference", "plain", "wrapper"):
        records, recorder = {"forward": [], "pre": [], "backward": [], "global": [], "calls": 0}, _Recorder()
        _GLOBAL_CALLS, _GLOBAL_RECORDS["outputs"] = 0, []
        model, handles = _hooked(records, recorder)
        target = fxflops.instrument(model, backward=backward) if label == "wrapper" else model
        try:
            if label == "reference":  # FlopCounterMode on the hooked model's call
                expected = flop_counter_call(model, (x.detach().requires_grad_(backward),), {}, backward=backward)
            else:
                _quietly(_step, target, x.detach().requires_grad_(backward), backward)
        finally:
            for handle in handles:
                handle.remove()
        seen[label] = (records, recorder, _GLOBAL_CALLS, list(_GLOBAL_RECORDS["outputs"]))
    assert target.flops.total() == expected and target.flops.uncounted == 0
    assert target.captures == 1 and target.measured == {}
    (records, recorder, calls, outputs), (plain, plain_recorder, plain_calls, plain_outputs) = seen["wrapper"], seen["plain"]
    for key in ("forward", "pre", "backward", "global"):
        assert len(records[key]) == len(plain[key]), key
        assert not any(_fake(value) for value in records[key]), key
        for got, want in zip(records[key], plain[key]):
            assert got == want if isinstance(want, torch.Size) else torch.equal(got, want), key
    assert records["calls"] == plain["calls"] == 1
    assert (recorder.calls, recorder.shapes, recorder.means) == (plain_recorder.calls, plain_recorder.shapes, plain_recorder.means)
    assert all(type(v) is float for v in recorder.means) and all(type(v) is int for v in recorder.shapes)
    assert calls == plain_calls == 1 and len(outputs) == 1 and torch.equal(outputs[0], plain_outputs[0])


# 3. caches of the model's code ---------------------------------------------------------------------

_MASKS: dict[int, torch.Tensor] = {}
_TABLE = None
_ASKED: "queue.Queue[str]" = queue.Queue()


@functools.lru_cache(maxsize=None)
def _rope(n: int, d: int) -> torch.Tensor:
    return torch.cos(torch.arange(n, dtype=torch.float32)[:, None] * torch.arange(d, dtype=torch.float32)[None, :])


@functools.cache
def _scale(d: int) -> torch.Tensor:
    return torch.full((d,), 0.5)


def _mask(n: int) -> torch.Tensor:
    if n not in _MASKS:
        _MASKS[n] = torch.tril(torch.ones(n, n))
    return _MASKS[n]


def _table(d: int) -> torch.Tensor:
    global _TABLE
    if _TABLE is None:
        _TABLE = torch.eye(d) * 2
    return _TABLE


def _ask_from_another_thread():
    """While the capture traces: what another thread gets from the user's lru cache."""
    worker = threading.Thread(target=lambda: _ASKED.put(type(_rope(8, 8)).__name__))
    worker.start()
    worker.join(timeout=10)


class _Cached(nn.Module):
    """Model code keeping tensors in module-level and class-level caches, keyed by a config size."""

    window: dict[int, torch.Tensor] = {}

    def __init__(self, length: int = 8) -> None:
        super().__init__()
        self.fc, self.length = nn.Linear(8, 8), length

    def forward(self, x):  # x: (batch, length, 8)
        if not isinstance(x.shape[0], int):  # inside a capture's trace
            _ask_from_another_thread()
        if self.length not in _Cached.window:
            _Cached.window[self.length] = torch.ones(self.length, self.length) / self.length
        y = (self.fc(x) + _rope(self.length, 8)) * _scale(8)
        return _Cached.window[self.length] @ (_mask(self.length) @ y) @ _table(8)


def _clear_caches():
    global _TABLE
    _rope.cache_clear(), _scale.cache_clear(), _MASKS.clear(), _Cached.window.clear()
    _TABLE = None


def test_the_models_caches_never_get_a_fake():
    """lru caches (``functools.lru_cache``, ``functools.cache``), a module-level dict, a class-level
    dict and a lazily set global, all filled by the model's code: after the first call none holds a
    fake, the wrapper's and the plain model's outputs are the plain model's, another thread asking
    the user's lru cache while the capture traces gets a real tensor, and the count is exact."""
    torch.manual_seed(0)
    model = _Cached()
    x = torch.randn(2, 8, 8)
    with torch.no_grad():
        expected = model(x)
    _clear_caches()
    while not _ASKED.empty():
        _ASKED.get()
    wrapper = fxflops.instrument(model, strict=True)
    with torch.no_grad():
        outputs = [wrapper(x), wrapper(x), model(x)]
    # traced twice: the second call finds the memos filled (what they hold decides whether their
    # work runs: another situation); both times the other thread got a real tensor
    assert list(_ASKED.queue) == ["Tensor", "Tensor"]
    for cached in (_rope(8, 8), _scale(8), _MASKS[8], _Cached.window[8], _TABLE):
        assert not isinstance(cached, FakeTensor)
    for out in outputs:
        assert not isinstance(out, FakeTensor) and torch.equal(out, expected)
    wrapper.flops.reset()
    with torch.no_grad():
        wrapper(x)
    assert wrapper.flops.total() == flop_counter_call(model, (x,), {}, backward=False)


# 4. argument objects with slots --------------------------------------------------------------------

class _SlotsCache:
    __slots__ = ("keys", "length")

    def __init__(self) -> None:
        self.keys, self.length = None, 0


@dataclasses.dataclass(slots=True)
class _DataclassCache:
    keys: torch.Tensor | None = None
    length: int = 0


class _LockedSlotsCache:
    """Cannot be deep-copied (a lock): traced as it is, its slots put back afterwards."""

    __slots__ = ("keys", "length", "lock")

    def __init__(self) -> None:
        self.keys, self.length, self.lock = None, 0, threading.Lock()


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, cache):
        keys = self.key(x)
        cache.keys = keys if cache.keys is None else torch.cat([cache.keys, keys], dim=1)
        cache.length += x.shape[1]
        return self.query(x) @ cache.keys.transpose(1, 2)


@pytest.mark.parametrize("kind", [_SlotsCache, _DataclassCache, _LockedSlotsCache], ids=lambda k: k.__name__.strip("_"))
def test_an_argument_object_with_slots_is_left_as_the_plain_model_leaves_it(kind):
    """A key-value cache whose class keeps its state in slots (also a slots dataclass, and one that
    cannot be copied): after each of three decoding steps it holds what the plain model's cache
    holds (real keys, a Python int length) and the outputs are the plain model's; the first call,
    whose capture traced the cache, counts exactly."""
    torch.manual_seed(0)
    model = _Decoder()
    wrapper = fxflops.instrument(model)
    cache, plain_cache = kind(), kind()
    for step, length in enumerate((5, 1, 1)):
        x = torch.randn(2, length, 8)
        with torch.no_grad():
            out = _quietly(wrapper, x, cache)
            expected = model(x, plain_cache)
        assert type(cache.length) is int and cache.length == plain_cache.length
        assert not isinstance(cache.keys, FakeTensor) and torch.equal(cache.keys, plain_cache.keys)
        assert not isinstance(out, FakeTensor) and torch.equal(out, expected)
        if step == 0:
            assert wrapper.flops.total() == flop_counter_call(model, (x, kind()), {}, backward=False)
    assert wrapper.flops.uncounted == 0


# 5. iterator arguments -----------------------------------------------------------------------------

class _Steps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x, steps):
        for _ in steps:
            x = self.layer(x)
        return x


def _steps(n):
    yield from range(n)


@pytest.mark.parametrize("make", [_steps, lambda n: iter(list(range(n)))], ids=["generator", "list_iterator"])
def test_an_iterator_argument_is_never_consumed_by_the_capture(make):
    """The real call gets the whole iterator (the output is the plain model's), and the calls are
    counted exactly for any length: the code that reads it is measured, the capture refused naming
    the argument."""
    torch.manual_seed(0)
    model = _Steps()
    wrapper = fxflops.instrument(model, strict=True)
    x = torch.randn(4, 8)
    for n in (2, 3, 1):
        wrapper.flops.reset()
        with torch.no_grad():
            out = wrapper(x, make(n))
            expected = model(x, make(n))
        assert torch.equal(out, expected)
        assert wrapper.flops.total() == flop_counter_call(model, (x, make(n)), {}, backward=False)
    assert "'steps'" in wrapper.measured[""] and "iterator" in wrapper.measured[""]
    refusing = fxflops.instrument(model, measure=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(refusing(x, make(2)), model(x, make(2)))
    assert refusing.flops.uncounted == 1 and any("'steps'" in str(w.message) for w in caught)


# 6. tensors the model holds outside its parameters and buffers ---------------------------------------

_STEPS_SEEN = torch.zeros(())


class _Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("average", torch.zeros(8))
        self.steps = torch.zeros((), dtype=torch.long)  # a plain tensor attribute
        self.history = [torch.zeros(8)]

    def forward(self, x):
        y = self.norm(self.fc(x))
        with torch.no_grad():
            self.average.mul_(0.9).add_(y.mean(0), alpha=0.1)
            self.steps.add_(1)
            self.history[0].add_(1.0)
            _STEPS_SEEN.add_(1)
            self.fc.weight.mul_(0.999)
        return y


def _state(model: _Stateful) -> dict[str, torch.Tensor]:
    return {**model.state_dict(), "steps": model.steps, "history": model.history[0], "global": _STEPS_SEEN}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "training"])
def test_in_place_updates_of_held_tensors_run_once(backward):
    """A plain tensor attribute used as a step counter, a tensor in a list attribute, a module-level
    tensor, buffers and a parameter updated in place: after every call each equals the plain
    model's, bit for bit, and each call counts exactly."""
    torch.manual_seed(0)
    model = _Stateful()
    plain = copy.deepcopy(model)
    wrapper = fxflops.instrument(model, backward=backward)
    for n in (4, 6, 4):
        x = torch.randn(n, 8)
        before = copy.deepcopy(plain)
        _STEPS_SEEN.zero_()
        wrapper.flops.reset()
        out = _quietly(_step, wrapper, x, backward)
        state = {k: v.clone() for k, v in _state(model).items()}
        _STEPS_SEEN.zero_()
        expected = _quietly(_step, plain, x, backward)
        assert torch.equal(out, expected)
        for key, value in _state(plain).items():
            assert torch.equal(state[key], value), key
        assert wrapper.flops.total() == flop_counter_call(before, (x,), {}, backward=backward)


# 7. Python and numpy random numbers ----------------------------------------------------------------

class _LayerDrop(nn.Module):
    """Skips its layer with probability 1/2 (Python's global generator, through a name bound at import)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x):
        return self.layer(x) if _coin() < 0.5 else x


_NUMPY_RNG = np.random.default_rng(11)  # a numpy Generator the code draws from (C methods: not patchable)


class _Coin:
    """A plain object the model holds, with a generator of its own."""

    def __init__(self) -> None:
        self.rng = random.Random(5)

    def flip(self) -> bool:
        return self.rng.random() < 0.5


class _Drawing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = _LayerDrop()
        self.repeat, self.scale = nn.Linear(8, 8), nn.Linear(8, 8)
        self.rng = random.Random(7)  # a generator the model holds
        self.coin = _Coin()

    def forward(self, x):
        x = self.drop(x)
        for _ in range(random.randint(1, 3) + self.rng.randint(0, 1)):
            x = self.repeat(x)
        if _NUMPY_RNG.random() < 0.5:
            x = self.repeat(x)
        if self.coin.flip():
            x = self.scale(x)
        return self.scale(x) * float(np.random.rand())


def _streams(model: _Drawing) -> tuple:
    """The user's random streams: Python's, numpy's (its key array as bytes), the model's own
    generators' and a numpy Generator's."""
    name, keys, *rest = np.random.get_state()
    return (
        random.getstate(), (name, keys.tobytes(), *rest), model.rng.getstate(), model.coin.rng.getstate(),
        _NUMPY_RNG.bit_generator.state,
    )


def _set_streams(model: _Drawing, streams: tuple) -> None:
    name, keys, *rest = streams[1]
    random.setstate(streams[0])
    np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32), *rest))
    model.rng.setstate(streams[2])
    model.coin.rng.setstate(streams[3])
    _NUMPY_RNG.bit_generator.state = streams[4]


def test_random_draws_are_measured_and_leave_the_users_streams_as_the_plain_model_does():
    """LayerDrop (``from random import random``), a loop count (``random.randint`` and a generator
    the model holds), a branch on a numpy Generator's draw and on a generator a held object keeps
    (were each one draw kept for every call) and a numpy draw: every call's output and count are those of the plain model on the same
    draws (FlopCounterMode), the user's random streams afterwards are the plain run's, and the
    modules whose own code draws are the ones measured."""
    torch.manual_seed(0)
    model = _Drawing()
    plain = copy.deepcopy(model)
    wrapper = fxflops.instrument(model, strict=True)
    random.seed(3)
    np.random.seed(3)
    for _ in range(8):
        x = torch.randn(4, 8)
        streams = _streams(model)
        wrapper.flops.reset()
        with torch.no_grad():
            out = wrapper(x)
        after = _streams(model)
        _set_streams(plain, streams)
        with torch.no_grad():
            assert torch.equal(out, plain(x))
        assert _streams(plain) == after
        _set_streams(plain, streams)
        assert wrapper.flops.total() == flop_counter_call(plain, (x,), {}, backward=False)
        _set_streams(model, after)
    assert "drop" in wrapper.measured and "random" in wrapper.measured["drop"]


def test_a_capture_leaves_the_global_random_streams_as_they_were():
    """A model that draws nothing: its capture (during which torch's size reasoning may draw from
    its own generators) consumes nothing of the user's streams and is not refused."""
    torch.manual_seed(0)
    wrapper = fxflops.instrument(MLP(), backward=True)
    random.seed(5)
    np.random.seed(5)
    before = random.getstate(), np.random.get_state()[1].tobytes()
    _quietly(_step, wrapper, torch.randn(4, 8, requires_grad=True), True)
    assert (random.getstate(), np.random.get_state()[1].tobytes()) == before
    assert wrapper.captures == 1 and wrapper.measured == {}


_TRACED_MODULES: queue.SimpleQueue = queue.SimpleQueue()  # the modules a replaced forward ran on while traced (a list would be put back after the capture)


def _forward_replaced(module: nn.Linear, style: str) -> None:
    """``module.forward`` replaced on the instance by a wrapper of its own forward, as accelerate's
    hooks and hand-written patches do: a ``functools.partial`` over the module, a closure over it, a
    default argument holding it. The wrapper adds two matmuls with the module's weight."""
    original = module.forward

    def wrapped(mod, x):
        if not isinstance(x.shape[0], int):  # inside the capture's trace
            _TRACED_MODULES.put(mod)
        return original(x) @ mod.weight @ mod.weight.T

    if style == "partial":
        module.forward = functools.partial(wrapped, module)
    elif style == "closure":
        module.forward = lambda x: wrapped(module, x)
    else:
        module.forward = lambda x, mod=module: wrapped(mod, x)


@pytest.mark.parametrize("style", ["partial", "closure", "default"])
def test_a_forward_replaced_on_the_instance_runs_on_the_twin(style):
    """The capture's twin holds the replaced forward made again over its own copy of the module:
    the trace runs the copy (fake weights, the copy's path in the breakdown), and the user's module
    keeps its own forward and weights. Counts equal FlopCounterMode's for every batch size."""
    model = MLP()
    for layer in (model.fc1, model.fc2):
        _forward_replaced(layer, style)
    kept = {name: getattr(model, name).forward for name in ("fc1", "fc2")}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrapper = fxflops.instrument(model, backward=True)
    while not _TRACED_MODULES.empty():
        _TRACED_MODULES.get()
    for batch in (4, 7, 2):
        x = torch.randn(batch, 8, requires_grad=True)
        wrapper.flops.reset()
        wrapper(x).sum().backward()
        assert wrapper.flops.total() == flop_counter_call(model, (x,), {}, backward=True), batch
        assert wrapper.flops.uncounted == 0 and wrapper.captures == 1
    traced = [_TRACED_MODULES.get() for _ in range(_TRACED_MODULES.qsize())]
    assert len(traced) == 2 and not any(m is model.fc1 or m is model.fc2 for m in traced)
    assert {name: getattr(model, name).forward for name in ("fc1", "fc2")} == kept
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())


class _TableAttribute(nn.Module):
    """An lru cache held as a module attribute (not rebound for the capture), then a line that reads
    tensor values: the capture fails after the trace filled the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.table = functools.lru_cache(maxsize=None)(lambda n: torch.ones(n, 8))

    def forward(self, x):
        h = self.fc(x) + self.table(8)[: x.shape[0]].sum()
        if h.sum() > 1e9:  # data-dependent: the symbolic capture fails here
            h = h * 2
        return h


def test_a_failed_trace_leaves_no_fake_in_an_lru_cache():
    """The failed trace's cache entry is cleared too (was: kept, and the measured real call that
    followed got the fake from the cache and raised into the user's step)."""
    model = _TableAttribute()
    wrapper = fxflops.instrument(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = wrapper(x)
        assert not isinstance(model.table(8), FakeTensor)
        assert torch.equal(out, model(x))
        wrapper.flops.reset()
        wrapper(x)
    assert wrapper.flops.total() == flop_counter_call(model, (x,), {}, backward=False)


class _ReentrantBlocks(nn.Module):
    """Blocks under a reentrant checkpoint (whose backward recomputes and differentiates the block
    itself), and a layer held unregistered (its parameters are not swapped for fakes by the trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2))
        self.__dict__["head"] = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return self.head(x)


def test_a_training_capture_leaves_no_fake_gradient_on_the_users_parameters():
    """The traced backward differentiates what the model's code differentiates: a reentrant
    checkpoint's backward (run inside the trace) and an unregistered layer accumulated fake
    gradients into the real parameters, which the real backward then kept (an optimizer step left
    the weights as they were). Gradients and an SGD step now equal the plain model's, bitwise."""
    torch.manual_seed(0)
    model, plain = _ReentrantBlocks(), _ReentrantBlocks()
    plain.load_state_dict(model.state_dict())
    plain.head.load_state_dict(model.head.state_dict())
    wrapper = fxflops.instrument(model, backward=True)
    for rows in (4, 7):
        x = torch.randn(rows, 16, requires_grad=True)
        wrapper.flops.reset()
        out = wrapper(x)
        everything = [*model.parameters(), *model.head.parameters()]
        assert not any(isinstance(p.grad, FakeTensor) for p in everything)
        out.sum().backward()
        plain(x).sum().backward()
        for mine, theirs in zip(everything, [*plain.parameters(), *plain.head.parameters()]):
            assert torch.equal(mine.grad, theirs.grad)
        assert wrapper.flops.total() == training_reference_total(copy.deepcopy(plain), x)  # the recompute too
    for m in (model, plain):
        torch.optim.SGD([*m.parameters(), *m.head.parameters()], lr=0.1).step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    assert wrapper.flops.uncounted == 0
