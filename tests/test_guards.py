"""Guards that evaluate: every guard a trace makes holds or fails correctly on later calls, whatever
functions its printed form uses (issue 13, point 2).

Sizes that go through ``int(n ** 0.5)`` (pixel shuffles in InternVL, Aya Vision, Llama 4),
``math.sqrt``/``float`` (a softmax scale from a symbolic head dim), ``//`` and ``%`` (patch merging,
padding to a multiple) make guards with ``TruncToInt``, ``FloatPow``, ``ToFloat``, ``FloorDiv``,
``Mod``, ``Min``/``Max``. Each model is counted, forward and training, on shapes on both sides of its
guards, against FlopCounterMode on the same call; the compiled guards also agree with sympy's own
evaluation at many points.
"""

from __future__ import annotations

import math
import random

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from reference import flop_counter_call


class PixelShuffle(nn.Module):
    """``h = int(n ** 0.5)`` patches per side (a square grid), merged 2x2 when ``h`` is even."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 12)
        self.merge = nn.Linear(48, 12)

    def forward(self, x):
        b, n, c = x.shape
        h = int(n ** 0.5)
        x = self.proj(x[:, : h * h])
        if h % 2 == 0:
            x = x.reshape(b, h // 2, 2, h // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, (h // 2) ** 2, 4 * c)
            return self.merge(x)
        return x


class ScaledAttention(nn.Module):
    """Attention with a scale computed from a symbolic head dim, ``d ** -0.5`` (a SymFloat: no guard)
    and, for wide heads, ``math.sqrt(float(d))`` (which fixes ``d``: one program per width)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 6)

    def forward(self, q, k, v):
        d = q.shape[-1]
        scale = d ** -0.5 if d < 8 else 1.0 / math.sqrt(float(d))
        weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)
        y = torch.matmul(weights, v)
        if d > 4:
            y = y * 2
        return self.out(y.transpose(-1, -2)).sum()


class PadToMultiple(nn.Module):
    """Pads the sequence to a multiple of 4 (``(-n) % 4``), pools by 4 (``//``), skips a layer past
    a length (``Min``/``Max`` appear in slicing)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.pool = nn.Linear(32, 8)

    def forward(self, x):
        b, n, c = x.shape
        x = F.pad(self.fc(x), (0, 0, 0, (-n) % 4))
        x = x.reshape(b, x.shape[1] // 4, 4 * c)
        y = self.pool(x)
        return y[:, : min(n, 6)].sum() + y.sum()


def _inputs(model: nn.Module, size: int, grad: bool = False) -> tuple:
    if isinstance(model, PixelShuffle):
        return (torch.randn(2, size, 12, requires_grad=grad),)
    if isinstance(model, ScaledAttention):
        return tuple(torch.randn(2, 6, size, requires_grad=grad) for _ in range(3))
    return (torch.randn(2, size, 8, requires_grad=grad),)


SIZES = {
    PixelShuffle: [16, 25, 36, 17, 49, 64, 24, 4, 9, 100],
    ScaledAttention: [2, 3, 4, 5, 8, 7, 16, 9, 6, 8],
    PadToMultiple: [4, 5, 6, 7, 8, 9, 13, 3, 2, 16],
}


@pytest.mark.parametrize("model_type", list(SIZES), ids=lambda t: t.__name__)
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_guards_through_sqrt_float_int_floor_and_mod(model_type, training):
    torch.manual_seed(0)
    model = model_type()
    wrapper = fxflops.instrument(model, backward=training, strict=True, max_programs=32)
    for size in SIZES[model_type]:
        inputs = _inputs(model, size, grad=training)
        wrapper.flops.reset()
        with torch.set_grad_enabled(training):
            out = wrapper(*inputs)
            if training:
                out.sum().backward()
            expected = flop_counter_call(model, inputs, {}, backward=training)
        assert wrapper.flops.total() == expected, (model_type.__name__, size)
    assert wrapper.captures < len(SIZES[model_type])  # programs are reused across their guards


def test_compiled_guards_agree_with_sympy_everywhere():
    """The generated ``within_guards`` against substitution into the guard expressions."""
    rng = random.Random(0)
    for model_type in SIZES:
        model = model_type()
        wrapper = fxflops.instrument(model, max_programs=32)
        with torch.no_grad():
            for size in SIZES[model_type]:
                wrapper(*_inputs(model, size))
        for program in wrapper.programs:
            assert program.guards, model_type.__name__
            for _ in range(200):
                values = tuple(rng.randint(1, 300) for _ in program.all_symbols)
                point = {s: sympy.Integer(v) for s, v in zip(program.all_symbols, values)}
                expected = all(bool(g.expr.xreplace(point)) for g in program.guards)
                assert program.within_guards(*values) == expected, (model_type.__name__, values)


def test_a_guard_the_printer_cannot_write_is_evaluated_exactly():
    """A guard whose printed Python cannot run falls back to sympy substitution (never wrong)."""
    from fxflops.binder import guard_evaluator

    s = sympy.Symbol("s", integer=True, positive=True)
    unknown = sympy.Function("NotPrintable")

    class Truthy(sympy.Function):
        @classmethod
        def eval(cls, x):
            if x.is_Integer:
                return sympy.true if int(x) % 3 else sympy.false
            return None

    assert guard_evaluator(sympy.Eq(s % 4, 1), (s,)) is None  # printed Python is exact: used as is
    evaluator = guard_evaluator(Truthy(s), (s,))
    assert evaluator is not None and [evaluator(v) for v in (3, 4, 5, 6)] == [False, True, True, False]
    del unknown


def test_a_guard_a_positive_symbol_makes_true_is_still_checked_at_zero():
    """A size derived from values (``capture/derived.py``) can be 0, though its symbol is a positive
    integer like every size: the printed guard ``n >= 1`` must stay a comparison, not sympy's True
    for a positive ``n`` (once, SmolVLM's all-padding frames passed its program's guard that way)."""
    from fxflops.binder import generated, python_source

    n = sympy.Symbol("n", integer=True, positive=True)
    at_least_one = sympy.Ge(n, 1, evaluate=False)
    printed = generated(f"def guard(v0):\n    return bool({python_source(at_least_one, {n: 'v0'})})\n", "guard")["guard"]
    assert [printed(v) for v in (0, 1, 2)] == [False, True, True]


def test_guards_on_derived_sizes_are_split_into_host_and_device_checks():
    """``fxflops/guards.py``: a factor R >= 1 cancels from an equality (a shape fact, host); a pinned
    R chooses the program (host); an inequality on R is deferred to the device flag; without R's
    minimum the factor stays (R = 0 would make any equality of multiples of R hold)."""
    from fxflops.capture.symbols import Guard
    from fxflops.guards import cancelled, split

    r, x, a = (sympy.Symbol(n, integer=True, positive=True) for n in ("R", "X", "A"))
    view = sympy.Eq(32 * r * x, 512 * r)
    assert cancelled(view, {r}) == sympy.Eq(32 * x - 512, 0) and cancelled(view, set()) == view
    assert cancelled(sympy.Ne(8 * r * a, 0), {r}) == sympy.Ne(8 * a, 0)
    guards = [Guard(view, "view"), Guard(sympy.Eq(r, 1), "pinned"), Guard(sympy.Ge(r, 1, evaluate=False), "minimum"),
              Guard(sympy.Le(r, 4 * a), "slice"), Guard(sympy.Ne(x, 1), "shapes")]
    host, deferred = split(guards, {r: 1})
    assert [g.location for g in host] == ["view", "pinned", "shapes"] and not host[0].expr.free_symbols & {r}
    assert [g.location for g in deferred] == ["minimum", "slice"]
    host, deferred = split(guards, {r: 0})
    assert [g.location for g in host] == ["view", "pinned", "shapes"] and host[0].expr.free_symbols & {r}


def test_a_guard_that_divides_by_a_size_is_kept_not_an_error():
    """A guard with a size as a divisor (Mllama's cross-attention ``view(bsz, -1, ...)``:
    ``(4*a*((b//8)*(c//8) + 1))//d >= 0``) cannot be proven at d = 0: it is kept as a guard (was:
    ZeroDivisionError from torch's ``FloorDiv``, or sympy's comparison of ``zoo``, refusing every
    call as an internal error)."""
    from fxflops.capture.symbols import always_true

    a, b, c, d = (sympy.Symbol(n, integer=True, nonnegative=True) for n in "abcd")
    sizes, names = {a, b, c, d}, dict(a=a, b=b, c=c, d=d)
    assert always_true(sympy.sympify("((4*a*((b//8)*(c//8) + 1))//d) >= 0", locals=names), sizes) is False
    assert always_true(sympy.sympify("(4*a*((b//8)*(c//8) + 1)) >= 0", locals=names), sizes) is True
