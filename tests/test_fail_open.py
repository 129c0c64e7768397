"""Telemetry never breaks a step, even in the corners hostile users reach (issue 13's promise, probed).

- Warnings turned into errors (``-W error``) do not turn fxflops' own warnings into exceptions.
- A module class that is not hashable can still be built after a capture (torch's global
  registration hooks that fxflops installs never raise).
- A model that calls its own wrapper from its forward does not hang and is counted once; an
  instrumented submodule inside an instrumented model counts its calls on its own meter, and the
  outer meter counts everything once.
- The model's own exception on a call whose capture failed (an ``assert``, a wrong feature size)
  propagates unchanged, with ``strict=True`` too, and does not make later valid calls uncounted
  or measured.
- An output fxflops' pytree does not know (a plain ``@dataclass``) still has its backward counted;
  an output holding a generator, whose tensors cannot be seen, is refused in training, never
  counted as a forward alone.
- ``report(peak_flops=0)`` has no MFU instead of dividing by zero.
- A Python argument that changes on every call (a packing collator's ``max_length``) makes a new
  situation each time: once ``max_programs`` are captured, further ones are measured whole, exactly,
  with one warning, instead of going uncounted (``measure=False``: uncounted, said).

Every count is compared with FlopCounterMode on the same call (``reference.flop_counter_call``).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings

import pytest
import torch
from torch import nn

import fxflops
from reference import assert_counted_call, flop_counter_call


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        if x.shape[0] > 16:
            raise ValueError(f"batch too large: {x.shape[0]}")
        return self.head(torch.relu(self.fc(x)))


def _counted(wrapper, x, backward=False):
    wrapper.flops.reset()
    out = wrapper(x)
    if backward:
        out.sum().backward()
    return wrapper.flops.total()


def test_warnings_as_errors_never_reach_the_step():
    class Unsupported(nn.Module):  # a capture that fails: its warning would be raised under -W error
        def forward(self, x):
            return x[: int((x[:, 0] > 0).sum()) + 1] @ x.T

    wrapper = fxflops.instrument(Unsupported(), measure=False)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = wrapper(x)
    assert torch.equal(out, Unsupported()(x))
    assert wrapper.flops.uncounted == 1


def test_an_unhashable_module_class_is_buildable_after_a_capture():
    wrapper = fxflops.instrument(Small())
    wrapper(torch.randn(4, 8))

    @dataclasses.dataclass(eq=True)
    class Holder(nn.Module):  # eq without hash: instances are unhashable
        width: int = 8

        def __post_init__(self):
            super().__init__()
            self.fc = nn.Linear(self.width, self.width)  # a registration torch's global hooks see

    with pytest.raises(TypeError):
        hash(Holder())
    assert Holder().fc.in_features == 8


class CallsItsWrapper(nn.Module):
    """A model whose forward calls the wrapper around it (held in ``calls``) once more."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = [self]

    def forward(self, x, depth: int = 0):
        x = self.fc(x)
        return self.calls[0](x, depth + 1) if depth < 1 else x


def test_a_model_calling_its_own_wrapper_is_counted_once_without_hanging():
    model = CallsItsWrapper()
    reference = flop_counter_call(model, (torch.randn(4, 8),), {}, backward=False)  # calls itself: two layers
    wrapper = fxflops.instrument(model)
    model.calls[0] = wrapper
    results = []
    worker = threading.Thread(target=lambda: results.extend(_counted(wrapper, torch.randn(4, 8)) for _ in range(2)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the wrapper's call waited for itself"
    assert results == [reference, reference]


def test_an_instrumented_submodule_counts_on_its_own_meter_and_once_in_the_outer():
    model = Small()
    inner = fxflops.instrument(model.fc)
    model.fc = inner
    outer = fxflops.instrument(model)
    for rows in (4, 6, 4):
        x = torch.randn(rows, 8)
        inner.flops.reset()
        expected_outer = flop_counter_call(Small().requires_grad_(False), (x,), {}, backward=False)
        with torch.no_grad():
            assert _counted(outer, x) == expected_outer
        assert inner.flops.total() == 2 * rows * 8 * 8  # one linear, counted once on its meter
    assert outer.captures == 1 and inner.captures == 1


@pytest.mark.parametrize("measure", [True, False])
def test_the_models_own_error_on_a_first_call_leaves_later_calls_counted(measure):
    wrapper = fxflops.instrument(Small(), measure=measure)
    with pytest.raises(ValueError, match="batch too large: 20"):
        wrapper(torch.randn(20, 8))
    for rows in (4, 5, 2):
        x = torch.randn(rows, 8)
        with torch.no_grad():
            assert _counted(wrapper, x) == flop_counter_call(Small(), (x,), {}, backward=False)
    assert wrapper.flops.uncounted == 0 and not wrapper.measured


@pytest.mark.parametrize("first_call_valid", [True, False])
def test_strict_lets_the_models_own_error_through_unchanged(first_call_valid):
    wrapper = fxflops.instrument(Small(), strict=True)
    if first_call_valid:
        wrapper(torch.randn(4, 8))
    with pytest.raises(ValueError, match="batch too large: 20"):
        wrapper(torch.randn(20, 8))


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    steps: int = 1


class _Slotted:
    __slots__ = ("logits",)

    def __init__(self, logits) -> None:
        self.logits = logits


class _Callable:
    def __init__(self, logits) -> None:
        self.logits = logits

    def __call__(self):
        return self.logits


class _Nested:
    def __init__(self, inner) -> None:
        self.inner = inner


class _DictOf(dict):
    pass


class _ListOf(list):
    pass


def _nested(depth):
    def make(logits):
        for _ in range(depth):
            logits = _Nested(logits)
        return logits

    return make


def _innermost(out):
    while isinstance(out, _Nested):
        out = out.inner
    return out


OUTPUT_HOLDERS = {  # how the output holds its tensor, how the user's loss reaches it
    "dataclass": (Output, lambda out: out.logits),
    "dict subclass": (lambda y: _DictOf(logits=y), lambda out: out["logits"]),
    "list subclass": (lambda y: _ListOf([y]), lambda out: out[0]),
    "set": (lambda y: {y}, lambda out: next(iter(out))),
    "object with slots": (_Slotted, lambda out: out.logits),
    "callable object": (_Callable, lambda out: out()),
    "objects 8 deep": (_nested(8), _innermost),
}


class ReturnsHeld(nn.Module):
    def __init__(self, holder) -> None:
        super().__init__()
        self.fc, self.holder = nn.Linear(8, 8), holder

    def forward(self, x):
        return self.holder(self.fc(x))


@pytest.mark.parametrize("holder", OUTPUT_HOLDERS)
def test_an_output_held_in_objects_pytree_does_not_know_has_its_backward_counted(holder):
    """Outputs pytree sees as one leaf are looked into (was: a dict or list subclass, a set, an
    object with slots, a callable object, or objects more than 4 deep: the backward never billed)."""
    make, loss_of = OUTPUT_HOLDERS[holder]
    model = ReturnsHeld(make)
    wrapper = fxflops.instrument(model, backward=True)
    for rows in (4, 6):
        x = torch.randn(rows, 8)
        wrapper.flops.reset()
        loss_of(wrapper(x)).sum().backward()
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            loss_of(model(x)).sum().backward()
        assert wrapper.flops.total() == counter.get_total_flops() and wrapper.flops.uncounted == 0


def test_an_output_nested_deeper_than_is_looked_into_is_refused_in_training():
    """Objects nested more than ``MAX_DEPTH`` deep may hide the tensors a backward starts from: the
    call is refused (said), never counted as a forward."""
    wrapper = fxflops.instrument(ReturnsHeld(_nested(12)), backward=True)
    with pytest.warns(UserWarning, match="nested more than"):
        out = wrapper(torch.randn(4, 8))
    _innermost(out).sum().backward()
    assert wrapper.flops.total() == 0 and wrapper.flops.uncounted == 1


class ReturnsGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return (row for row in y)


def test_an_output_generator_is_refused_in_training_never_counted_as_a_forward():
    wrapper = fxflops.instrument(ReturnsGenerator(), backward=True)
    with pytest.warns(UserWarning, match="iterator"):
        rows = list(wrapper(torch.randn(4, 8)))
    torch.stack(rows).sum().backward()
    assert wrapper.flops.total() == 0 and wrapper.flops.uncounted == 1
    with torch.no_grad():  # no backward can follow: the forward is counted
        assert _counted(wrapper, torch.randn(4, 8)) == 2 * 4 * 8 * 8


def test_a_report_with_peak_zero_has_no_mfu():
    wrapper = fxflops.instrument(Small())
    wrapper(torch.randn(4, 8))
    report = wrapper.flops.report(elapsed_s=1.0, peak_flops=0)
    assert report.mfu is None and report.hfu is None
    assert "no MFU" in str(report)


class Truncating(nn.Module):
    """Its Python argument ``keep`` changes which rows are computed: every value is its own situation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, keep: int):
        return self.head(torch.relu(self.fc(x[:, :keep].transpose(1, 2).contiguous().transpose(1, 2))))


@pytest.mark.parametrize("backward", [False, True])
def test_past_max_programs_new_situations_are_measured_whole_and_exact(backward):
    model = Truncating()
    wrapper = fxflops.instrument(model, backward=backward, max_programs=2)
    calls = [(3, 5), (2, 7), (4, 2), (3, 6), (2, 7), (5, 1)]  # (batch, keep): the last four are past the bound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch, keep in calls:
            assert_counted_call(wrapper, model, (torch.randn(batch, 9, 8, requires_grad=backward), keep), backward, (batch, keep))
    assert wrapper.captures == 2
    said = [str(w.message) for w in caught if "max_programs" in str(w.message)]
    assert len(said) == 1 and "measured op by op" in said[0] and "keep" in said[0]


def test_past_max_programs_without_measuring_a_call_is_uncounted_and_said():
    model = Truncating()
    wrapper = fxflops.instrument(model, max_programs=1, measure=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for keep in (5, 6):
            wrapper.flops.reset()
            wrapper(torch.randn(2, 9, 8), keep)
    assert wrapper.flops.total() == 0 and wrapper.flops.uncounted == 1 and wrapper.captures == 1
    assert any("max_programs=1" in str(w.message) for w in caught)


POOL_SCRIPT = r'''
import concurrent.futures, warnings, torch
from torch import nn
import fxflops

POOL = concurrent.futures.ThreadPoolExecutor(2)


class Branches(nn.Module):
    """Runs two branches of its forward on a thread pool."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        fa, fb = POOL.submit(self.a, x), POOL.submit(self.b, x)
        return self.c(fa.result() + fb.result())


torch.manual_seed(0)
model = Branches()
wrapper = fxflops.instrument(model)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for rows in (4, 4, 6, 4):
        x = torch.randn(rows, 16)
        with torch.no_grad():
            assert torch.equal(wrapper(x), model(x))
assert wrapper.flops.calls == 0 and wrapper.flops.uncounted == 4, (wrapper.flops.calls, wrapper.flops.uncounted)
assert any("another thread" in str(w.message) for w in caught), [str(w.message) for w in caught]
try:
    fxflops.trace(model, (torch.randn(4, 16),))
except fxflops.CaptureError as exc:
    assert "another thread" in str(exc) and exc.module is None, exc
else:
    raise AssertionError("traced a model whose work ran on other threads")
for _ in range(3):
    with torch.no_grad():
        model(torch.randn(4, 16))
POOL.shutdown()
print("ok")
'''


def test_a_model_computing_on_a_thread_pool_is_refused_and_never_aborts_the_process():
    """The model hands the call's tensors to a thread pool. Under a trace those are fake tensors,
    which torch would compute with on the worker threads outside the trace (an undercount, or the
    call measured without the workers' ops) and whose mode state it would leave broken there: torch
    aborted the process later. Each call is refused with a warning (neither a trace nor a
    measurement sees other threads), outputs are the model's own, and the process exits cleanly (in
    a subprocess with a time limit, twice: the abort was intermittent)."""
    import subprocess
    import sys

    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp", "dual level"])
def test_a_call_inside_a_torch_func_transform_or_forward_ad_is_not_counted_and_said(transform):
    """Under ``torch.vmap`` the model's code sees one sample's tensors (counted as one sample, the
    work of the whole batch was missed); ``grad``/``jvp`` and forward-mode AD compute more than the
    call's outputs. Such calls are not counted, with a warning naming the transform, and the
    model's result is unchanged."""
    import torch.autograd.forward_ad as forward_ad

    model = Small()
    wrapper = fxflops.instrument(model)
    x, samples = torch.randn(3, 8), torch.randn(7, 3, 8)
    wrapper(x)  # captured outside any transform
    wrapper.flops.reset()
    calls = {
        "vmap": lambda f: torch.vmap(f)(samples),
        "grad": lambda f: torch.func.grad(lambda v: f(v).sum())(x),
        "jvp": lambda f: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1],
    }

    def dual(f):
        with forward_ad.dual_level():
            return forward_ad.unpack_dual(f(forward_ad.make_dual(x, torch.ones_like(x)))).tangent

    calls["dual level"] = dual
    with pytest.warns(UserWarning, match="inside"):
        got = calls[transform](wrapper)
    assert torch.allclose(got, calls[transform](model))
    assert wrapper.flops.calls == 0 and wrapper.flops.uncounted == 1 and wrapper.flops.total() == 0


class _MadeOnFirstCall(nn.Module):
    """A lazy layer: its weight is made, and its class becomes ``nn.Linear``, on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.LazyLinear(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.fc(x))


@pytest.mark.parametrize("backward", [False, True])
def test_a_lazy_module_is_measured_on_its_first_call_then_captured(backward):
    """A model instrumented before its lazy parameters exist: its first call is measured (exact),
    the later ones counted by a program captured once they exist (was: every call uncounted, the
    first failed capture refusing the later calls)."""
    model = _MadeOnFirstCall()
    wrapper = fxflops.instrument(model, backward=backward)
    for batch in (4, 2, 3, 5):
        assert_counted_call(wrapper, model, (torch.randn(batch, 8),), backward, batch)
    assert len(wrapper.programs) == 1 and wrapper.captures == 1


class _Normalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("first", [0, 4])
def test_a_size_whose_capture_fails_outside_any_module_is_measured_at_that_size(first):
    """An empty batch in a training BatchNorm (torch's own check refuses a symbolic batch there, in
    no module's code fxflops can name): that call is measured (exact), and only calls of its size
    class; other sizes keep their captured program (was: the call not counted)."""
    model = _Normalized()
    wrapper = fxflops.instrument(model, backward=True)
    for batch in (first, 4 - first, 0, 3):
        assert_counted_call(wrapper, model, (torch.randn(batch, 3, 6, 6),), True, batch)
    assert wrapper.captures == 1 and len(wrapper.measured) == 1


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _ReadsRows(_Branching):
    def forward(self, x):  # a row count read from the values: no symbolic trace, measured
        rows = int((x > 0).sum()) % x.shape[0] + 1
        return self.down(torch.relu(self.up(x[:rows])))


TORCHSCRIPT = {
    "jit.trace": lambda: torch.jit.trace(_Branching(), torch.randn(3, 16)),
    "jit.script": lambda: torch.jit.script(_Branching()),
    "jit.script, values read": lambda: torch.jit.script(_ReadsRows()),
}


@pytest.mark.parametrize("kind", TORCHSCRIPT)
def test_a_torchscript_model_is_counted_exactly(kind):
    """A traced TorchScript module has no Python signature (its schema's arguments are used:
    ``instrument()`` raised ValueError); a scripted one measured calls its submodules inside
    TorchScript, none of them routed (every call raised RuntimeError from ``get_submodule``)."""
    model = TORCHSCRIPT[kind]()
    wrapper = fxflops.instrument(model, backward=True)
    for rows in (3, 5, 7):
        x = torch.randn(rows, 16)
        wrapper.flops.reset()
        wrapper(x).sum().backward()
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            model(x).sum().backward()
        assert wrapper.flops.total() == counter.get_total_flops() and wrapper.flops.uncounted == 0


def test_a_fault_routing_a_measured_call_leaves_it_uncounted_never_raised(monkeypatch):
    from fxflops.islands import MeasuredCall

    def fault(self, paths):
        raise RuntimeError("injected")

    model = _ReadsRows()
    wrapper = fxflops.instrument(model)
    monkeypatch.setattr(MeasuredCall, "_route", fault)
    x = torch.randn(5, 16)
    with pytest.warns(UserWarning, match="injected"):
        out = wrapper(x)
    assert torch.equal(out, model(x)) and wrapper.flops.uncounted == 1 and wrapper.flops.total() == 0
