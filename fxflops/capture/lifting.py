"""Per-segment lifting: a module whose work is per segment, traced once on a single segment.

Some modules loop over the pieces of a packed input in Python — Hugging Face's vision attention splits
q, k, v with ``torch.split(..., lengths.tolist())`` — so no symbolic trace of the whole batch can go
through them: the number of pieces and their lengths are data. But their work is a polynomial P(s) of
one piece's length s, so over a batch it is Σᵢ P(sᵢ) = Σₖ cₖ·pₖ with the segment power sums pₖ.

``per_segment={"visual.blocks.*.attn": "cu_seqlens"}`` names such modules (``fnmatch`` patterns over
module paths) and the forward argument holding their cumulative offsets. During the capture each
matching module's ``forward`` is temporarily replaced by a stand-in that:

1. traces the real forward once on **one segment**, in a fake mode of its own: every tensor argument
   whose dim 0 is the packed length gets the symbol ``s`` there; the offsets are a 2-element fake
   tensor whose values the code reads (``.tolist()``/``.item()`` give data-dependent sizes) are
   resolved by evaluating that slice of the graph on ``[0, s]``;
2. returns ``fxflops::per_segment`` marker nodes into the outer graph, shaped like the real outputs and
   carrying the packed input and the offsets, so that the Program bills P as Σₖ cₖ·pₖ of the offsets'
   segment family (see ``analysis/segments.py``): its forward in the phase the markers ran in (the
   forward, or an activation checkpoint's recompute), its backward once for each call whose markers'
   backward ran (``fxflops::per_segment_grad`` nodes carry the call's number).

In the outer graph (``capture/markers.py`` has the marker ops)::

    before (cannot trace):  out = blocks.0.attn(x, cu_seqlens)   # splits q, k, v by cu_seqlens.tolist()
    after:                  out = fxflops.per_segment(x, cu_seqlens, [P, D], float32, True, 0)
    and, traced apart:      blocks.0.attn on one segment of length s -> P(s) = 4·D·s² + 8·D²·s

Modules of one type and parameter shapes called the same way are traced once. Conditions on ``s``
alone that the one-segment trace relies on (``s > 1``) are checked on every segment of a batch;
conditions involving other sizes are refused.
Rows past the last offset would be processed but not billed, so the offsets must cover the packed
length exactly (the binder checks it). In a joint forward+backward capture the one-segment trace is
joint too (its backward billed like its forward), and the marker's backward hands the packed input a
gradient (``fxflops::per_segment_grad``) so that the backward upstream of the module is traced.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import itertools
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.fx.experimental.symbolic_shapes import DimDynamic

from fxflops.capture.fake_mode import ThreadBoundFakeMode
from fxflops.capture.graph import TENSOR, op_name, trace_graph
from fxflops.capture.markers import per_segment_marker
from fxflops.capture.phases import own_phases
from fxflops.capture.reuse import layer_attributes, layer_state
from fxflops.capture.shape_env import BlamingShapeEnv
from fxflops.errors import CaptureError

SEGMENT = sympy.Symbol("s", integer=True, positive=True)


@dataclass(frozen=True)
class Lifted:
    """A lifted module's single-segment trace; ``in_s`` maps its sizes to expressions in ``s``;
    ``conditions`` are the conditions on ``s`` the trace relied on (``s > 1``), which every segment
    of a batch must meet (the binder checks them on the segment lengths)."""

    graph_module: torch.fx.GraphModule
    in_s: Any
    conditions: tuple[sympy.Expr, ...] = ()
    path: str = ""  # the module traced; others of the same kind and call are billed as copies of it


class _OffsetsValues:
    """Values read from the offsets in a single-segment trace, evaluated on ``[0, s]``."""

    _SAME = {"_to_copy", "clone", "detach", "alias", "contiguous", "view", "reshape", "_unsafe_view", "lift_fresh_copy"}
    _ARITHMETIC = {"sub": operator.sub, "add": operator.add, "mul": operator.mul}

    def __init__(self, graph: torch.fx.Graph, offsets: torch.fx.Node) -> None:
        self.values: dict[torch.fx.Node, Any] = {offsets: [sympy.Integer(0), SEGMENT]}
        self.unbacked: dict[sympy.Symbol, sympy.Expr] = {}
        for node in graph.nodes:
            if node.op == "call_function" and any(isinstance(a, torch.fx.Node) and a in self.values for a in node.args):
                value = self._evaluate(node)
                if value is not None:
                    self.values[node] = value

    def _evaluate(self, node: torch.fx.Node) -> Any:
        name = op_name(node.target)
        args = [self.values.get(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
        x = args[0]
        if name in self._SAME:
            return x
        if name == "slice" and isinstance(x, list) and args[1] == 0:
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            end = args[3] if len(args) > 3 and args[3] is not None else len(x)
            return x[start : min(end, len(x))]
        if name in self._ARITHMETIC and isinstance(x, list):
            op, y = self._ARITHMETIC[name], args[1]
            return [op(a, b) for a, b in zip(x, y)] if isinstance(y, list) else [op(a, y) for a in x]
        if name == "select" and isinstance(x, list) and args[1] == 0:
            return x[args[2]]
        if name == "unbind" and isinstance(x, list):
            return list(x)
        if name == "getitem" and isinstance(x, list):
            return x[args[1]]
        if name == "sum" and isinstance(x, list):
            return sympy.Add(*x)
        if name == "_local_scalar_dense" and isinstance(x, sympy.Expr):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
                self.unbacked[val.node.expr] = x
            return x
        return None


def _hint(size: Any, fallback: int = 2) -> int:
    """A size's example value; ``fallback`` for a data-dependent size, which has none."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    return int(size.node.hint) if size.node.hint is not None else fallback


def _unbacked(size: Any) -> bool:
    return isinstance(size, torch.SymInt) and size.node.hint is None


def _same_size(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return isinstance(a, int) and isinstance(b, int) and a == b


def _packed_rows(value: Any, rows: Any) -> bool:
    """Whether tensor ``value`` runs along the packed rows: its dim 0 is ``rows``, or is a symbolic
    size equal to it in the example (a table built from other inputs, e.g. rotary cos/sin from
    precomputed position ids; :func:`_tie_to_rows` makes that equality a guard of the outer trace)."""
    if not isinstance(value, torch.Tensor) or not value.dim():
        return False
    size = value.shape[0]
    return _same_size(size, rows) or (isinstance(size, torch.SymInt) and _hint(size, _hint(rows)) == _hint(rows))


def _tie_to_rows(bound: inspect.BoundArguments, rows: Any, offsets: Any) -> None:
    """In the outer trace, assert that every argument taken as packed has exactly ``rows`` rows, so
    a batch where they differ falls outside the program's guards instead of being billed wrongly."""
    for value in pytree.tree_leaves((bound.args, bound.kwargs)):
        if value is not offsets and _packed_rows(value, rows) and not _unbacked(value.shape[0]):
            torch._check(value.shape[0] == rows)


def trace_segment(
    module: torch.nn.Module, path: str, bound: inspect.BoundArguments, offsets_name: str, backward: bool = False,
    shapes: dict[int, torch.Size] | None = None,
) -> tuple[Lifted, list]:
    """Trace ``module`` on one segment of symbolic length ``s`` (see the module docstring).

    Returns the trace and, per tensor output, its (shape in ``s``, dtype). ``shapes``: the parameters'
    shapes as this rank computes with them (``trace_graph``).
    """
    packed = next(v for v in pytree.tree_leaves((bound.args, bound.kwargs)) if isinstance(v, torch.Tensor))
    rows = packed.shape[0]
    env = BlamingShapeEnv()
    mode = ThreadBoundFakeMode(shape_env=env, allow_non_fake_inputs=True)
    source = ConstantSource("s")
    hint = max(_hint(rows), 2)
    sym = env.create_symbol(hint, source, DimDynamic.DYNAMIC, positive=None, do_not_specialize_zero_one=True)
    s = env.create_symintnode(sym, hint=hint, source=source)
    offsets = bound.arguments.get(offsets_name)
    if not isinstance(offsets, torch.Tensor):
        raise CaptureError(f"per-segment module {path!r}: argument {offsets_name!r} is not a tensor of offsets")

    def one_segment(value: Any) -> Any:
        if isinstance(value, torch.SymInt):  # a size read from the offsets (e.g. max_seqlen): one segment's is s
            return s
        if not isinstance(value, torch.Tensor):
            return value
        if value is offsets:
            return torch.empty(2, dtype=value.dtype, device=value.device)
        sizes = [_hint(d, hint) for d in value.shape]
        # packed along dim 0: the same size as the packed input, or a size the outer trace could only
        # get from data (rotary tables built per image) whose example value equals it
        if _packed_rows(value, rows):
            sizes[0] = s
        return torch.empty(sizes, dtype=value.dtype, device=value.device).requires_grad_(value.requires_grad)

    with mode:
        args, kwargs = pytree.tree_map(one_segment, (bound.args, bound.kwargs))
    fake_offsets = next(
        f for f, v in zip(pytree.tree_leaves((args, kwargs)), pytree.tree_leaves((bound.args, bound.kwargs))) if v is offsets
    )
    gm = trace_graph(module, mode, args, kwargs, backward, shapes=shapes)
    mode.check()
    inputs = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    offsets_node = placeholders[next(i for i, t in enumerate(inputs) if t is fake_offsets)]
    resolved = _OffsetsValues(gm.graph, offsets_node).unbacked
    conditions = [g.expr.xreplace({sym: SEGMENT}) for g in env.guards]
    conditions = [c for c in conditions if c is not sympy.true]  # e.g. s >= 0 holds for any length
    uncheckable = [c for c in conditions if not _is_bound(c)]
    if uncheckable:
        raise CaptureError(
            f"per-segment module {path!r} relies on conditions on the segment length "
            f"({[str(c) for c in uncheckable]}) that fxflops cannot check for every segment"
        )

    def in_s(size: Any) -> sympy.Expr:
        expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
        return sympy.expand(env.replace(expr).xreplace(resolved).xreplace({sym: SEGMENT}))

    structure = gm.meta["output_structure"][1]
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0][: sum(leaf is TENSOR for leaf in structure)]
    outs = [(tuple(in_s(d) for d in o.meta["val"].shape), o.meta["val"].dtype) for o in output]
    return Lifted(gm, in_s, tuple(conditions), path), outs


def _is_bound(condition: sympy.Basic) -> bool:
    """A condition on ``s`` alone (``s > 1``, ``32*s != 32``, ``s % 2 == 0``): checkable per segment."""
    return condition.free_symbols == {SEGMENT}


def lifted_paths(model: torch.nn.Module, patterns: dict[str, str]) -> list[str]:
    """Paths of the modules of ``model`` that ``patterns`` lift."""
    return [path for path, _ in model.named_modules() if path and any(fnmatch.fnmatchcase(path, p) for p in patterns)]


@contextlib.contextmanager
def install_stand_ins(
    model: torch.nn.Module, patterns: dict[str, str], backward: bool = False, ignored: frozenset[str] = frozenset(),
    shapes: dict[int, torch.Size] | None = None,
) -> Iterator[dict[str, Lifted]]:
    """Replace the forward of every module matching ``patterns`` by a lifting stand-in for the
    duration of a capture (``model`` is the twin a capture traces, ``capture/isolation.py``); yields
    ``{module path: Lifted}`` filled as the capture calls them. With ``backward`` each one-segment
    trace is a joint forward+backward trace. Modules of one kind (reuse's strict match, ``ignored``
    attributes aside) called the same way are traced once; ``Lifted.path`` names the one traced.
    ``shapes``: the parameters' shapes as this rank computes with them (``trace_graph``)."""
    lifted: dict[str, Lifted] = {}
    if not patterns:
        yield lifted
        return
    matches = {
        path: (module, offsets)
        for path, module in model.named_modules()
        for pattern, offsets in patterns.items()
        if path and fnmatch.fnmatchcase(path, pattern)
    }
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(path, p) for path in matches)]
    if unmatched:
        raise CaptureError(f"per_segment pattern(s) {unmatched} match no module of {type(model).__name__}")
    cache: dict[tuple, tuple[Lifted, list]] = {}
    calls = itertools.count()
    for path, (module, offsets_name) in matches.items():
        module.forward = _stand_in(module, path, offsets_name, lifted, cache, backward, ignored, calls, shapes)
    try:
        yield lifted
    finally:
        for module, _ in matches.values():
            del module.forward


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _stand_in(
    module: torch.nn.Module, path: str, offsets_name: str, lifted: dict, cache: dict, backward: bool, ignored: frozenset[str],
    calls: Iterator[int], shapes: dict[int, torch.Size] | None,
) -> Any:
    original = type(module).forward.__get__(module)
    signature = inspect.signature(original)
    tracing_segment = [False]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if tracing_segment[0]:  # the one-segment trace itself
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        packed = next(v for v in pytree.tree_leaves((bound.args, bound.kwargs)) if isinstance(v, torch.Tensor))
        offsets = bound.arguments[offsets_name]
        _tie_to_rows(bound, packed.shape[0], offsets)
        key = (  # the same kind of module (reuse's strict match), called the same way
            type(module),
            layer_state(module),
            layer_attributes(module, ignored),
            tuple(
                (type(v).__name__, v.dtype, v.dim(), v.requires_grad) if isinstance(v, torch.Tensor) else repr(v)
                for v in pytree.tree_leaves((bound.args, bound.kwargs))
            ),
            torch.is_grad_enabled(),
        )
        if key not in cache:
            tracing_segment[0] = True  # the single-segment trace runs the real forward
            try:
                # its own trace: outside the outer trace's modes, and outside any activation
                # checkpoint the module is called in (whose saved-tensor hooks would recompute the
                # checkpointed block when the one-segment backward reads a saved tensor)
                with disable_proxy_modes_tracing(), unset_fake_temporarily(), own_phases(), \
                        torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    cache[key] = trace_segment(module, path, bound, offsets_name, backward, shapes)
            finally:
                tracing_segment[0] = False
        lifted[path], outs = cache[key]
        call = next(calls)
        markers = []
        for i, (shape, dtype) in enumerate(outs):
            sizes = []
            for d in shape:
                if d == SEGMENT:
                    sizes.append(packed.shape[0])
                elif d.is_Integer:
                    sizes.append(int(d))
                else:
                    raise CaptureError(f"per-segment module {path!r} returns a dim {d} that is not the segment length")
            markers.append(per_segment_marker(packed, offsets, sizes, dtype, i == 0, call))
        spec, leaves = lifted[path].graph_module.meta["output_structure"]
        tensors = iter(markers)
        return pytree.tree_unflatten([next(tensors) if leaf is TENSOR else leaf for leaf in leaves], spec)

    return forward
