"""The capture's symbols: one per requested dim name, the fake inputs of those sizes, the
integers argument objects hold, and what the model's code did to them (pins, guards).

Every symbol is created in the capture's own :class:`BlamingShapeEnv` with ``DYNAMIC`` and
``do_not_specialize_zero_one`` so that equal example sizes never merge and size-1 examples stay free;
the public symbol of a name is a positive integer sympy symbol of that name (:func:`named_symbol`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic

from fxflops.capture.inputs import DimSpec, Path, held_root, own_attributes, path_label, reach
from fxflops.capture.shape_env import BlamingShapeEnv, format_location
from fxflops.errors import InputError, PinnedSymbolError


def named_symbol(name: str) -> sympy.Symbol:
    """The public symbol for a size called ``name``: a positive integer."""
    return sympy.Symbol(name, integer=True, positive=True)


@dataclass(frozen=True)
class Guard:
    """A condition on the symbols that the trace relied on, and the model line that made it."""

    expr: sympy.Basic
    location: str

    def __str__(self) -> str:
        return f"{self.expr}  ({self.location})"


def symbolic_inputs(
    env: BlamingShapeEnv,
    mode: FakeTensorMode,
    tensors: dict[Path, torch.Tensor],
    specs: list[DimSpec],
) -> tuple[dict[Path, torch.Tensor], dict[str, sympy.Symbol]]:
    """Fake tensors for ``tensors`` whose spec'd dims are SymInts (one symbol per distinct name)."""
    by_name: dict[str, tuple[Any, int]] = {}
    sizes: dict[Path, list[Any]] = {path: list(t.shape) for path, t in tensors.items()}
    for spec in specs:
        example = tensors[spec.path].shape[spec.dim]
        if spec.name not in by_name:
            source = ConstantSource(spec.name)
            sym = env.create_symbol(
                example, source, DimDynamic.DYNAMIC, positive=None, do_not_specialize_zero_one=True
            )
            env.sizes.add(sym)
            by_name[spec.name] = (env.create_symintnode(sym, hint=example, source=source), example)
        symint, first = by_name[spec.name]
        if example != first:
            raise InputError(
                f"symbol {spec.name!r} names sizes {first} and {example} in the example call; "
                "one symbol must have one value"
            )
        sizes[spec.path][spec.dim] = symint
    fakes = {}
    with mode:
        for path, tensor in tensors.items():
            fakes[path] = fake_like(tensor, sizes[path])
    env_syms = {name: symint.node.expr for name, (symint, _) in by_name.items()}
    return fakes, env_syms


def fake_like(tensor: torch.Tensor, sizes: list[Any]) -> torch.Tensor:
    """A tensor (a fake, in the caller's mode) of ``sizes`` that answers every question a model may
    ask of ``tensor`` as ``tensor`` does: dtype, device, ``requires_grad``, inference mode, its plain
    Python attributes, and its memory layout (:func:`strides_like`: ``is_contiguous()``, ``stride()``, channels-last). Kinds of
    tensor no such fake stands for are refused before (``inputs.refuse_untraceable``)."""
    strides = strides_like(tensor, sizes)
    with torch.inference_mode(tensor.is_inference()):
        if strides is None:  # contiguous: torch's own strides
            fake = torch.empty(sizes, dtype=tensor.dtype, device=tensor.device)
        else:
            fake = torch.empty_strided(sizes, strides, dtype=tensor.dtype, device=tensor.device)
    attributes = own_attributes(tensor)
    if attributes:  # its plain Python attributes (``x.packed = True``), put on the traced input (``graph.py``)
        fake.fxflops_attributes = dict(attributes)
    return fake.requires_grad_(True) if tensor.requires_grad else fake


def strides_like(tensor: torch.Tensor, sizes: list[Any]) -> list[Any] | None:
    """``tensor``'s strides written over ``sizes`` (its sizes, some of them symbols); None when it is
    contiguous (the fake takes torch's own contiguous strides).

    Walking the dimensions from the innermost (increasing stride; ties to the later dimension, as in
    a contiguous tensor), a dimension whose stride is the product of the sizes inside it gets that
    product over ``sizes``: a dense tensor in any dimension order (transposed, channels-last) keeps
    its layout at every size of the symbols. A broadcast dimension (stride 0, size > 1) stays 0. A
    stride that is no such product (a slice of a wider tensor: 16 for sizes (4, 8)) is the example's
    own constant, and the dimensions outside it products over it: exact for this call; at another
    size only the layout of the same wider tensor (the call key tells such calls apart by their
    strides). A size-1 dimension's stride means nothing to torch's layout tests: the product. An
    empty tensor is contiguous, whatever its strides."""
    shape, real = tuple(tensor.shape), tuple(tensor.stride())
    if tensor.numel() == 0 or tensor.is_contiguous():
        return None
    strides: list[Any] = [0] * len(shape)
    expected, product = 1, 1  # the stride a dense next dimension has: as an int, and over ``sizes``
    for d in sorted((d for d in range(len(shape)) if real[d] != 0 or shape[d] == 1), key=lambda d: (real[d], -d)):
        if shape[d] != 1 and real[d] != expected:
            expected, product = real[d], real[d]
        strides[d] = product
        expected, product = expected * shape[d], product * sizes[d]
    return strides


def symbolic_ints(
    env: BlamingShapeEnv, integers: dict[Path, int], env_syms: dict[str, sympy.Symbol], names: dict[Path, str] | None = None
) -> dict[Path, Any]:
    """A SymInt for every integer an argument object holds or a symbolic integer argument is, named
    ``names[path]`` or after its path (added to ``env_syms``). An object's integer is any integer (a
    negative value is possible); a symbolic argument (``names``) not negative in the example is a
    size, as a length is (slicing by it gives a size), which its program guards (``capture/trace.py``)."""
    names = names or {}
    return {
        path: named_symint(env, names.get(path, path_label(path)), example, env_syms, size=path in names and example >= 0)
        for path, example in integers.items()
    }


def named_symint(
    env: BlamingShapeEnv, name: str, example: int, env_syms: dict[str, sympy.Symbol], size: bool = True
) -> torch.SymInt:
    """A SymInt of a new symbol ``name`` with the example value ``example`` as its hint (added to
    ``env_syms``): a derived size's (``capture/derived.py``), a count never negative (``size``: in
    :attr:`BlamingShapeEnv.sizes`), or an integer input's."""
    if name in env_syms:
        raise InputError(f"two sizes of the call are both named {name!r}")
    source = ConstantSource(name)
    sym = env.create_symbol(example, source, DimDynamic.DYNAMIC, positive=None, do_not_specialize_zero_one=True)
    if size:
        env.sizes.add(sym)
    env_syms[name] = sym
    return env.create_symintnode(sym, hint=example, source=source)


def check_free(env: BlamingShapeEnv, env_syms: dict[str, sympy.Symbol], strict: bool) -> dict:
    """Raise if the model pinned or merged a requested symbol (``strict``), else report the pins."""
    pinned = {}
    for name, sym in env_syms.items():
        target = env.replacements.get(sym)
        vr = env.var_to_range.get(sym)
        if target is None and vr is not None and vr.is_singleton():
            target = sympy.Integer(int(vr.lower))
        if target is None:
            continue
        pinned[name] = target
        if strict:
            where = format_location(
                getattr(env.replacements_slocs.get(sym), "framework_loc", None)
            )
            what = (
                f"fixed to {target}"
                if not target.free_symbols
                else f"tied to {target.xreplace({s: sympy.Symbol(n) for n, s in env_syms.items()})}"
            )
            raise PinnedSymbolError(
                f"symbol {name!r} is not free: the model code {what} at {where}. "
                f"Remove {name!r} from dims, or change the code so the size can vary."
            )
    return pinned


def held_paths(tensors: dict[Path, Any]) -> list[Path]:
    """The paths of the tensors held by argument objects, in input order."""
    return [path for path in tensors if held_root(path) is not None]


def held_inputs(named: dict[str, Any], fakes: dict[Path, torch.Tensor]) -> list[tuple[Any, Path, torch.Tensor]]:
    """(the object in the trace's own copy of the call, the steps below it, the fake) for every tensor
    an argument object holds (see :func:`trace_graph`)."""
    held = []
    for path in held_paths(fakes):
        root = held_root(path)
        held.append((reach(named[path[0]], path[1 : root + 1]), path[root + 1 :], fakes[path]))
    return held


def in_public_symbols(env: BlamingShapeEnv, env_to_named: dict[sympy.Symbol, sympy.Symbol], expr: Any) -> sympy.Expr:
    """A ShapeEnv expression (SymInt or sympy) in the public symbols, replacements applied."""
    if isinstance(expr, torch.SymInt):
        expr = expr.node.expr
    return env.replace(sympy.sympify(expr)).xreplace(env_to_named)


def guards_of(env: BlamingShapeEnv, env_to_named: dict[sympy.Symbol, sympy.Symbol]) -> list[Guard]:
    """The conditions the trace relied on, in the public symbols, each with the model line that made it.

    A condition is dropped only when it holds for every value its symbols can take
    (:func:`always_true`): not merely for every *public* symbol, which is positive, or sympy calls
    ``Ne(8*batch, 0)`` (the model's ``if x.numel() == 0``) true and drops the one guard that keeps a
    program traced at ``batch = 4`` from counting ``batch = 0``. The kept condition is written in the
    public symbols unevaluated, for the same reason. A condition made again (by another line) is
    kept once, with the first line that made it."""
    guards: dict[sympy.Basic, Guard] = {}
    for guard in env.guards:
        expr = env.replace(sympy.sympify(guard.expr))
        if expr in guards or always_true(expr, env.sizes):
            continue
        with sympy.evaluate(False):
            public = expr.xreplace({sym: env_to_named.get(sym, sym) for sym in expr.free_symbols})
        guards[expr] = Guard(public, format_location(guard.sloc.framework_loc))
    return list(guards.values())


MAX_SPLIT_SIZES = 6  # sizes of one condition split into 0 / positive (2^k cases); more: kept as a guard


def always_true(condition: sympy.Basic, sizes: set[sympy.Symbol]) -> bool:
    """Whether ``condition`` holds for every value of its symbols: each size in ``sizes`` any integer
    >= 0, any other symbol (an integer an argument object holds) any integer.

    sympy decides a condition over positive integers well and over non-negative ones badly
    (``(s > 0) | Eq(32*s, s)`` is true for every s >= 0, but not to sympy). So the sizes are split:
    the condition must be true, as sympy evaluates it, with each subset of them 0 and the others
    positive symbols. Sound (each case is sympy's proof over its domain, and the cases cover every
    value); a condition with more than :data:`MAX_SPLIT_SIZES` sizes is kept."""
    on_sizes = sorted(condition.free_symbols & sizes, key=str)
    if len(on_sizes) > MAX_SPLIT_SIZES:
        return False
    others = {sym: sympy.Symbol(sym.name, integer=True) for sym in condition.free_symbols - sizes}
    for zeros in itertools.product((False, True), repeat=len(on_sizes)):
        case = {sym: sympy.Integer(0) if zero else sympy.Symbol(sym.name, integer=True, positive=True) for sym, zero in zip(on_sizes, zeros)}
        try:
            if condition.xreplace({**others, **case}) is not sympy.true:
                return False
        except (ZeroDivisionError, TypeError):  # a size divides there (``(4*s0*k) // s1 >= 0`` at s1 = 0): not proven, kept
            return False
    return True
