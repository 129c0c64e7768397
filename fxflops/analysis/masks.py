"""What an attention node says about its mask: causal flags, masks read from the graph, and notes
on masks fxflops cannot read.

A model that hands its attention kernel a mask tensor usually builds it in the traced graph from
positions: Hugging Face's ``masking_utils`` turns ``kv_idx <= q_idx`` and
``attention_mask[batch_idx, kv_idx]`` into ``arange`` tensors, comparisons and an ``index`` of the
padding vector, then ``where(keep, 0, -inf)``::

    q = arange(Q)[None, None, :, None] + past      k = arange(K)[None, None, None, :]
    keep = ones() & (k <= q) & attention_mask.bool()[arange(B)[:, None, None, None], k]
    attn_mask = where(keep, 0.0, -inf)             # -> scaled_dot_product_attention(..., attn_mask)

:class:`MaskReader` follows that slice by abstract interpretation (as ``segments.py`` follows the
offsets): each value is a :class:`Position` (an integer tensor whose element is its index along one
axis plus an offset), a :class:`Keep` (a boolean tensor: a conjunction of linear conditions on the
positions and lookups of input tensors at positions), a :class:`Difference` of two positions, an
input or a scalar. :func:`read_causal`
recognises the conjunction "key ≤ query + c", optionally with "the padding input is non-zero at
(batch, key)": a :class:`CausalMask`. Anything else stays unread: counted dense, with a note.

Packed sequences without ``attention_mask`` (``find_packed_sequence_indices``): HF cuts each row of
``position_ids`` into runs of consecutive positions, ``seq = (diff(pos, prepend=pos[:, :1] - 1) != 1)
.cumsum(-1)``, and keeps a pair when ``seq[b, q] == seq[b, k]`` and ``pos[b, k] ≤ pos[b, q]``. Integer
inputs looked up at positions are sympy function applications in the relations; a run id is an
:class:`Input` with ``runs``. Inside one run the positions step by 1, so ``pos[b, k] − pos[b, q] =
k − q``: the mask is causal within each run, a block-diagonal :class:`CausalMask` with ``runs``.

Attention written as matrix products (``eager`` attention: ``softmax(Q·Kᵀ·scale + mask)·V``) has
no attention op to carry the mask: :func:`eager_attention` finds the two ``bmm`` nodes and the mask
added between them, so both products are counted as causal when the mask reads so.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from fxflops.capture.graph import op_name
from fxflops.capture.inputs import Path

_MASK_ARGUMENTS = ("attn_mask", "attn_bias")
CAUSAL_ARGUMENTS = ("is_causal", "causal")


def given_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (positional and keyword)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return dict(node.kwargs)
    return dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)


def is_causal(node: torch.fx.Node) -> bool:
    """True if an attention call says it is causal (``is_causal=True`` / varlen ``causal=True``)."""
    given = given_arguments(node)
    return any(given.get(name) is True for name in CAUSAL_ARGUMENTS)


def mask_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The mask tensor an attention node is given (``attn_mask`` / ``attn_bias``), if any."""
    given = given_arguments(node)
    return next((given[name] for name in _MASK_ARGUMENTS if isinstance(given.get(name), torch.fx.Node)), None)


def mask_notes(node: torch.fx.Node, path: str) -> list[str]:
    """Attention given a mask fxflops cannot read (a dense mask tensor, a flex block mask) is counted
    as dense work, under every convention; say so."""
    if "flex_attention" in str(node.target):
        return [
            f"{path or '<root>'}: {node.target}'s score_mod and block mask are not read; counted dense under "
            "every convention (a causal block mask is not halved)"
        ]
    given = given_arguments(node)
    return [
        f"{path or '<root>'}: {node.target} has a mask ({name}); counted as the dense work the kernel does, "
        "masked entries included (a block-diagonal mask over packed sequences costs (Σsᵢ)² here, not Σsᵢ²)"
        for name in _MASK_ARGUMENTS
        if isinstance(given.get(name), torch.fx.Node)
    ]


def unread_eager_note(path: str) -> str:
    """Attention written as matrix products whose mask is not read from the graph (built in a way
    :func:`read_causal` does not follow): counted dense under every convention; say so."""
    return (
        f"{path or '<root>'}: attention as matrix products (eager) with a mask that is not read from the graph; "
        "counted as the dense work, masked entries included, under every convention (causal ones too)"
    )


def axis(a: int) -> sympy.Symbol:
    """The index along the ``a``-th dim counted from the last one (0: keys, 1: queries, 3: batch)."""
    return sympy.Symbol(f"x{a}", integer=True, nonnegative=True)


@dataclass(frozen=True)
class Position:
    """An integer tensor whose element is its index along ``axis`` (from the last dim) + ``offset``."""

    axis: int
    offset: sympy.Expr

    @property
    def value(self) -> sympy.Expr:
        return axis(self.axis) + self.offset


@dataclass(frozen=True)
class Difference:
    """An integer tensor whose element is a linear expression in its indices along several axes
    (``q_pos − k_pos``: a difference of two positions) or in an integer lookup (``pos[b, q] − W``);
    only compared, never moved."""

    expr: sympy.Expr


@dataclass(frozen=True)
class Keep:
    """A boolean tensor, true where every relation ``r ≤ 0`` holds and every looked-up input is
    non-zero (``lookups``: (input path, its index per dim, in the axes))."""

    relations: frozenset[sympy.Expr] = frozenset()
    lookups: frozenset[tuple[Path, tuple[sympy.Expr, ...]]] = frozenset()

    def __and__(self, other: Keep) -> Keep:
        return Keep(self.relations | other.relations, self.lookups | other.lookups)


@dataclass(frozen=True)
class Input:
    """An integer or boolean input tensor, or a view or lookup of it: element ``input[index]``
    (``index``: per input dim, in the axes; a dim broadcast from size 1 is read at 0). ``as_bool``:
    read as "non-zero". ``runs``: not the input's value but the id of the run of consecutive values
    (each one more than the one before) it lies in, along the input's last dim (packed sequences)."""

    path: Path
    as_bool: bool
    index: tuple[sympy.Expr, ...]
    runs: bool = False

    @classmethod
    def of(cls, path: Path, as_bool: bool, rank: int) -> Input:
        return cls(path, as_bool, tuple(axis(rank - 1 - d) for d in range(rank)))

    def at(self, indices: list[Position]) -> tuple[sympy.Expr, ...]:
        """This tensor's index composed with a lookup ``self[indices]`` (one position per dim of
        this tensor, a view of the input: its rank is ``len(indices)``)."""
        rank = len(indices)
        return tuple(i.xreplace({axis(rank - 1 - d): p.value for d, p in enumerate(indices)}) for i in self.index)


@dataclass(frozen=True)
class CausalMask:
    """Keeps key ``k`` for query ``q`` when ``k ≤ q + offset``, with a sliding ``window`` also
    ``k > q + offset − window`` (the last ``window`` keys), and (with ``padding``) the padding input
    is non-zero at (batch, k). With ``runs`` (an integer input of positions) only pairs inside one
    run of consecutive positions of the row (one packed sequence), where ``offset`` is 0, or None:
    no causal bound, the whole block (a bidirectional packed mask)."""

    offset: sympy.Expr | None
    padding: Path | None
    window: sympy.Expr | None = None
    runs: Path | None = None


_SAME = {"clone", "alias", "contiguous", "lift_fresh_copy", "detach", "_assert_tensor_metadata"}
# a OP b -> sign·(a − b) + strict ≤ 0 for each (sign, strict); eq: both a − b ≤ 0 and b − a ≤ 0
_COMPARISONS = {"le": ((1, 0),), "lt": ((1, 1),), "ge": ((-1, 0),), "gt": ((-1, 1),), "eq": ((1, 0), (-1, 0))}
_NEGATIVE_INFINITY = -1e30  # a where() branch at least this negative drops the entry (-inf, finfo.min)


@dataclass(frozen=True)
class KeptPairs:
    """Σ over batch rows b and keys k < ``keys`` of [padding[b, k] ≠ 0] · #{q < ``queries`` :
    k ≤ q + ``offset`` (and k > q + ``offset`` − ``window``)}: the query-key pairs a causal mask with
    padding, or a sliding window, keeps. With padding its value is data: the binder computes it from
    the padding input with tensor ops on that input's device; without (``padding`` None, a window),
    ``batch`` times the sum over keys, from the sizes (piecewise in them: no polynomial).

    With ``runs`` (packed sequences: the positions input whose runs of consecutive values are the
    sequences, its rows broadcast to ``batch``) the pairs inside each run: with n(q) the place of
    query q in its run (1 for its first token), Σ n(q) (causal: Σᵢ sᵢ(sᵢ+1)/2), Σ min(n(q), window)
    (a window), or with ``offset`` None Σ (2·n(q) − 1) = Σᵢ sᵢ² (the whole blocks); data too."""

    padding: Path | None
    queries: sympy.Expr
    keys: sympy.Expr
    offset: sympy.Expr | None
    window: sympy.Expr | None = None
    batch: sympy.Expr | None = None  # the rows, when there is no padding input to count them
    runs: Path | None = None


def pairs_kept(mask: CausalMask, batch: sympy.Expr, queries: sympy.Expr, keys: sympy.Expr) -> sympy.Expr | KeptPairs | None:
    """The (batch, query, key) triples ``mask`` keeps. Without padding or window, for the usual
    alignment of the last query with the last key (offset = keys − queries: a prefill, a decode step
    after a cache): B · Σ_k min(Q, K − k) = B·(Q·K − Q(Q−1)/2); other offsets are not summed (None).
    With padding, a window or runs: a :class:`KeptPairs` statistic."""
    if mask.runs is not None:
        return KeptPairs(None, queries, keys, mask.offset, mask.window, batch, mask.runs)
    if mask.padding is not None or mask.window is not None:
        return KeptPairs(mask.padding, queries, keys, mask.offset, mask.window, None if mask.padding is not None else batch)
    if sympy.simplify(mask.offset - (keys - queries)) != 0:
        return None
    return sympy.expand(batch * (queries * keys - queries * (queries - 1) / 2))


def whole_blocks(mask: CausalMask, batch: sympy.Expr, queries: sympy.Expr, keys: sympy.Expr) -> sympy.Expr | KeptPairs:
    """The triples ``mask`` admits before its causal bound and window: B·Q·K, or with ``runs``
    the pairs of the blocks, Σᵢ sᵢ² (what ``causal="half"`` halves)."""
    if mask.runs is None:
        return sympy.expand(batch * queries * keys)
    return KeptPairs(None, queries, keys, None, None, batch, mask.runs)


def _relation(value: Any) -> sympy.Expr | None:
    if isinstance(value, Position):
        return value.value
    if isinstance(value, Difference):
        return value.expr
    if isinstance(value, (int, sympy.Expr)) and not isinstance(value, bool):
        return sympy.sympify(value)
    return None


_ORDERED = (Position, Difference)  # integer values a comparison bounds (besides integer lookups)


def _as_keep(value: Any) -> Keep | None:
    """A boolean value as a conjunction: a Keep, or an input read as non-zero at its index."""
    if isinstance(value, Input) and value.as_bool:
        return Keep(lookups=frozenset({(value.path, value.index)}))
    return value if isinstance(value, Keep) else None


class MaskReader:
    """Abstract values of the graph slice that builds attention masks (module docstring), computed
    on demand from the mask node back to the call's inputs. ``placeholders`` maps graph inputs to
    their paths; ``named`` puts a traced size in the public symbols."""

    def __init__(self, placeholders: dict[torch.fx.Node, Path], named: Any) -> None:
        self.placeholders = placeholders
        self.named = named
        self._values: dict[torch.fx.Node, Any] = {}
        self.sources: dict[Any, tuple[Path, bool]] = {}  # lookup function -> (input, runs)
        self._functions: dict[tuple[Path, bool], Any] = {}

    def lookup(self, value: Input) -> sympy.Expr:
        """An integer input (or its run ids) at ``value.index`` as a function application."""
        key = (value.path, value.runs)
        if key not in self._functions:
            function = sympy.Function(f"{'runs' if value.runs else 'values'}_{len(self._functions)}")
            self._functions[key], self.sources[function] = function, key
        return self._functions[key](*value.index)

    def relation(self, value: Any) -> sympy.Expr | None:
        """``value`` as a term of a linear relation: a position, a difference, a number, or an
        integer lookup."""
        if isinstance(value, Input) and not value.as_bool:
            return self.lookup(value)
        return _relation(value)

    def value(self, node: Any) -> Any:
        if isinstance(node, (list, tuple)):
            return [self.value(n) for n in node]
        if not isinstance(node, torch.fx.Node):
            return node
        if node not in self._values:
            self._values[node] = None  # a node is never its own input; this guards the recursion anyway
            self._values[node] = self._transfer(node)
        return self._values[node]

    def _transfer(self, node: torch.fx.Node) -> Any:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return self.named(val)
        if node.op == "placeholder":
            floating = not isinstance(val, torch.Tensor) or val.dtype.is_floating_point
            return None if floating or node not in self.placeholders else Input.of(self.placeholders[node], val.dtype == torch.bool, val.dim())
        if node.op != "call_function" or not isinstance(val, torch.Tensor):
            return None
        rule = getattr(self, f"_on_{op_name(node.target)}", None)
        if rule is None and op_name(node.target) in _SAME:
            rule = MaskReader._on_same
        return None if rule is None else rule(node, [self.value(a) for a in node.args], val)

    @staticmethod
    def _on_same(node: torch.fx.Node, args: list, val: torch.Tensor) -> Any:
        return args[0] if isinstance(args[0], (Position, Keep, Input)) else None

    def _spans(self, operand: Any, value: Any, out: torch.Tensor) -> bool:
        """Every axis ``value`` (a Position, or an Input's index) varies along has the output's full
        size in the tensor ``operand`` (not a size-1 dim broadcast: that would hold one value)."""
        if not isinstance(operand, torch.fx.Node) or not isinstance(operand.meta.get("val"), torch.Tensor):
            return not isinstance(value, (Position, Difference, Input, Keep))
        own = operand.meta["val"]
        varying = set()
        if isinstance(value, Position):
            varying = {axis(value.axis)}
        elif isinstance(value, Difference):
            varying = value.expr.free_symbols
        elif isinstance(value, Input):
            varying = set().union(*(i.free_symbols for i in value.index))
        elif isinstance(value, Keep):
            varying = set().union(*(r.free_symbols for r in value.relations), *(i.free_symbols for _, index in value.lookups for i in index))
        axes = {a for a in range(max(own.dim(), out.dim())) if axis(a) in varying}
        return all(
            a < own.dim() and a < out.dim() and sympy.expand(self.named(own.shape[-1 - a]) - self.named(out.shape[-1 - a])) == 0
            for a in axes
        )

    def _on_expand(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Any:
        """A view into more (or wider) dims: an input's dims broadcast from size 1 are read at 0."""
        value, own = args[0], node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(value, Input) and isinstance(own, torch.Tensor):
            one = [(self.named(own.shape[-1 - a]) == 1, self.named(val.shape[-1 - a]) == 1) for a in range(min(own.dim(), val.dim()))]
            ones = {axis(a): sympy.Integer(0) for a, (was, stays) in enumerate(one) if was and not stays}
            value = Input(value.path, value.as_bool, tuple(i.xreplace(ones) for i in value.index), value.runs)
        return value if self._spans(node.args[0], value, val) else None

    def _on_arange(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Position | None:
        start = args[0] if len(args) > 1 else 0
        step = args[2] if len(args) > 2 else 1
        return Position(0, sympy.sympify(start)) if step == 1 and val.dim() == 1 else None

    def _on_add(self, node: torch.fx.Node, args: list, val: torch.Tensor, sign: int = 1) -> Position | Difference | None:
        position, other = args[0], args[1] if len(args) > 1 else None
        alpha = node.kwargs.get("alpha", 1)
        constant = _relation(other) is not None and not isinstance(other, _ORDERED)
        if isinstance(position, Position) and constant:
            return Position(position.axis, sympy.expand(position.offset + sign * alpha * _relation(other)))
        if isinstance(position, Input) and not position.as_bool and constant:  # a looked-up value shifted
            return Difference(sympy.expand(self.lookup(position) + sign * alpha * _relation(other)))
        positions = isinstance(position, Position) and isinstance(other, Position) and position.axis != other.axis
        if positions and all(self._spans(n, v, val) for n, v in zip(node.args[:2], (position, other))):
            return Difference(sympy.expand(position.value + sign * alpha * other.value))  # positions along two axes
        return None

    def _on_sub(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Position | None:
        return self._on_add(node, args, val, sign=-1)

    def _on_unsqueeze(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Any:
        """A new dim at ``dim``: the axes left of it are one further from the last dim."""
        value, dim, rank = args[0], args[1] % val.dim(), val.dim() - 1
        shifted = {axis(a): axis(a + 1) for a in range(rank) if rank - 1 - a < dim}
        if isinstance(value, Position):
            return Position(value.axis + (axis(value.axis) in shifted), value.offset)
        if isinstance(value, Keep):
            lookups = {(path, tuple(i.xreplace(shifted) for i in index)) for path, index in value.lookups}
            return Keep(frozenset(r.xreplace(shifted) for r in value.relations), frozenset(lookups))
        if isinstance(value, Input):
            return Input(value.path, value.as_bool, tuple(i.xreplace(shifted) for i in value.index), value.runs)
        return None

    def _on_slice(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Any:
        """A slice that keeps its whole dim: start 0, step 1, end at or past the dim's size."""
        dim = args[1] if len(args) > 1 else 0
        start, end = (args[2] if len(args) > 2 else 0), (args[3] if len(args) > 3 else None)
        step = args[4] if len(args) > 4 else 1
        size = self.named(node.args[0].meta["val"].shape[dim])
        whole = end is None or (isinstance(end, int) and end >= 2**62) or sympy.simplify(sympy.sympify(end) - size) == 0
        return args[0] if isinstance(args[0], (Position, Keep, Input)) and start in (0, None) and step == 1 and whole else None

    def _on__to_copy(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Any:
        value = args[0]
        if isinstance(value, Input):
            return Input(value.path, value.as_bool or val.dtype == torch.bool, value.index, value.runs)
        if isinstance(value, Keep) and val.dtype == torch.bool:
            return value
        return value if isinstance(value, Position) and not val.dtype.is_floating_point else None

    def _on_compare(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Keep | None:
        a, b = (self.relation(v) for v in args[:2])
        ordered = any(isinstance(v, _ORDERED) or (isinstance(v, Input) and not v.as_bool) for v in args[:2])
        if a is None or b is None or not ordered:
            return None
        if not all(self._spans(operand, v, val) for operand, v in zip(node.args[:2], args[:2])):
            return None
        return Keep(relations=frozenset(sympy.expand(sign * (a - b) + strict) for sign, strict in _COMPARISONS[op_name(node.target)]))

    _on_le = _on_lt = _on_ge = _on_gt = _on_eq = _on_compare

    def _on_ones(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Keep | None:
        return Keep() if val.dtype == torch.bool else None

    _on_new_ones = _on_ones

    def _on_zeros(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> float | None:
        """A floating 0-d zeros tensor (``where(keep, zeros([]), min)``, the eager mask) is 0."""
        return 0.0 if val.dtype.is_floating_point and val.dim() == 0 else None

    def _on_bitwise_and(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Keep | None:
        a, b = (_as_keep(v) for v in args[:2])
        if a is None or b is None or val.dtype != torch.bool:
            return None
        spanning = all(self._spans(operand, v, val) for operand, v in zip(node.args[:2], args[:2]))
        return a & b if spanning else None

    _on_logical_and = _on_mul = _on_bitwise_and

    def _on_index(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Keep | Input | None:
        """An input looked up at positions (one per dim): read as non-zero (a Keep), or its
        integer values there (an Input at the composed index)."""
        source, indices = args[0], args[1]
        if not isinstance(source, Input) or not all(isinstance(i, Position) for i in indices):
            return None
        if not all(self._spans(operand, i, val) for operand, i in zip(node.args[1], indices)):
            return None
        if len(indices) != node.args[0].meta["val"].dim():
            return None
        if source.as_bool:
            return Keep(lookups=frozenset({(source.path, source.at(indices))}))
        return Input(source.path, False, source.at(indices), source.runs)

    def _on_cumsum(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Input | None:
        """Run ids: ``(diff(pos, prepend=pos[..., :1] - 1) != 1).cumsum(-1)`` (``_run_starts``)."""
        if len(args) < 2 or args[1] % val.dim() != val.dim() - 1:
            return None
        positions = self._run_starts(node.args[0], val.dim())
        return None if positions is None else Input(positions.path, False, positions.index, runs=True)

    def _run_starts(self, node: Any, rank: int) -> Input | None:
        """The positions input P when ``node`` is ``torch.diff(P, dim=-1, prepend=P[..., :1] - 1) != 1``
        as ``torch.diff`` decomposes (ATen's ``diff``: ``cat([prepend, P], -1)``, then
        ``narrow(1, n−1) − narrow(0, n−1)``): true where a new run of consecutive positions starts,
        except at the first element (the prepended ``P[..., 0] − 1`` steps by 1)."""
        last = rank - 1

        def call(n: Any, op: Any, *leading: Any) -> bool:
            """``n`` calls ``op`` with these leading arguments after the first (dims taken mod rank)."""
            if not (isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is op):
                return False
            given = [a % rank if i == 0 and op is _aten.slice.Tensor and isinstance(a, int) else a for i, a in enumerate(n.args[1:])]
            return given[: len(leading)] == list(leading)

        if not call(node, _aten.ne.Scalar, 1) or not call(node.args[0], _aten.sub.Tensor):
            return None
        later, earlier = node.args[0].args[:2]
        if not (call(later, _aten.slice.Tensor, last, 1) and call(earlier, _aten.slice.Tensor, last, 0)):
            return None
        joined = later.args[0]
        if earlier.args[0] is not joined or not call(joined, _aten.cat.default) or len(joined.args[0]) != 2:
            return None
        size = self.named(joined.meta["val"].shape[-1])
        if any(sympy.expand(self.named(n.meta["val"].shape[-1]) - (size - 1)) != 0 for n in (later, earlier)):
            return None
        (first, positions), dim = joined.args[0], joined.args[1] if len(joined.args) > 1 else 0
        source = self.value(positions)
        if dim % rank != last or not isinstance(source, Input) or source.as_bool or source.runs or source.index[-1] != axis(0):
            return None
        if not call(first, _aten.sub.Tensor, 1) or not call(first.args[0], _aten.slice.Tensor, last, 0, 1):
            return None
        return source if self.value(first.args[0].args[0]) == source else None

    def _on_scalar_tensor(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> float:
        return float(args[0])

    def _on_where(self, node: torch.fx.Node, args: list, val: torch.Tensor) -> Keep | None:
        keep, kept, dropped = args[:3]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (kept, dropped))
        if isinstance(keep, Keep) and numbers and kept == 0 and (dropped <= _NEGATIVE_INFINITY or math.isinf(dropped)):
            return keep
        return None


def read_causal(reader: MaskReader, mask: torch.fx.Node) -> CausalMask | None:
    """The mask as "key ≤ query + c" (optionally "key ≥ query − d": a sliding window of c + d + 1
    keys; and a padding input non-zero at (batch, key); or only inside the runs of a positions
    input, :func:`_within_runs`), else None."""
    keep, rank = reader.value(mask), mask.meta["val"].dim()
    if not isinstance(keep, Keep) or len(keep.lookups) > 1 or rank < 2:
        return None
    runs, relations = _within_runs(reader, keep.relations, rank)
    if relations is None or len(relations) > 2 or not (relations or runs):
        return None
    bounds = {}  # +1: key − query − c ≤ 0 (causal), −1: query − key − d ≤ 0 (the window's far end)
    for relation in relations:
        side = relation.coeff(axis(0))
        constant = sympy.expand(relation - side * (axis(0) - axis(1)))
        if side not in (1, -1) or side in bounds or constant.free_symbols & {axis(a) for a in range(rank)}:
            return None
        bounds[side] = -constant
    if bounds and 1 not in bounds:
        return None
    offset = bounds.get(1)
    window = None if -1 not in bounds else sympy.expand(offset + bounds[-1] + 1)
    if runs is not None:  # inside a run: causal from its first token, or the whole block
        return CausalMask(offset, None, window, runs) if offset in (None, 0) and not keep.lookups else None
    if not keep.lookups:
        return CausalMask(offset, None, window)
    ((path, index),) = keep.lookups
    return CausalMask(offset, path, window) if rank == 4 and index == (axis(3), axis(0)) else None


def _within_runs(reader: MaskReader, relations: frozenset[sympy.Expr], rank: int) -> tuple[Path | None, set[sympy.Expr] | None]:
    """The positions input whose runs the mask keeps pairs inside ("the run id at (b, q) equals the
    one at (b, k)", b the batch axis or row 0 broadcast), and the other relations with its values
    at (b, k) and (b, q) read as k and q: inside a run of consecutive positions ``pos[b, k] −
    pos[b, q] = k − q`` (a relation with the values in any other way is not read). (None, the
    relations) without runs; (None, None) when a lookup is left that is not read."""
    lookups = {f for r in relations for f in r.atoms(sympy.core.function.AppliedUndef)}
    if not lookups:
        return None, set(relations)
    runs = {f for f in lookups if reader.sources[f.func][1]}
    functions = {f.func for f in runs}
    if len(functions) != 1 or rank != 4:
        return None, None
    (function,) = functions
    rows = {f.args[0] for f in runs}
    if len(rows) != 1 or any(len(f.args) != 2 for f in runs) or not rows <= {axis(3), sympy.Integer(0)}:
        return None, None
    (row,) = rows
    same = function(row, axis(1)) - function(row, axis(0))
    if {same, -same} - set(relations) or runs != {function(row, axis(1)), function(row, axis(0))}:
        return None, None
    path = reader.sources[function][0]
    values = next((f for f, (p, r) in reader.sources.items() if p == path and not r), None)
    start = sympy.Dummy("start")  # the run's first position: cancels in every relation that is read
    inside = {} if values is None else {values(row, axis(a)): axis(a) + start for a in (0, 1)}
    kept = set()
    for relation in set(relations) - {same, -same}:
        read = sympy.expand(relation.xreplace(inside))
        if read.free_symbols & {start} or read.atoms(sympy.core.function.AppliedUndef):
            return None, None
        kept.add(read)
    return path, kept


_aten = torch.ops.aten
_SCORE_STEPS = {  # ops between the scores Q·Kᵀ and the weights that multiply V, that keep (b, q, k) in place
    _aten.view.default, _aten._unsafe_view.default, _aten.expand.default, _aten.clone.default, _aten._to_copy.default,
    _aten.mul.Tensor, _aten.div.Tensor, _aten.mul.Scalar, _aten.div.Scalar, _aten.alias.default,
}
_SOFTMAX = {_aten._softmax.default, _aten.softmax.int, _aten._safe_softmax.default}
_BMM = _aten.bmm.default


@dataclass(frozen=True)
class EagerAttention:
    """Attention written as matrix products (Hugging Face's ``eager_attention_forward``): ``scores``
    = Q·Kᵀ (a ``bmm``), ``add`` adds the ``mask`` to the (B, H, Q, K) scores, a softmax, and the
    ``weighted`` ``bmm`` multiplies the weights by V."""

    scores: torch.fx.Node
    weighted: torch.fx.Node
    add: torch.fx.Node
    mask: torch.fx.Node


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float))


def _trace_scores(node: Any, seen: dict[str, Any]) -> torch.fx.Node | None:
    """Walk back from the first operand of a ``bmm`` through the ops of :data:`_SCORE_STEPS`
    (scaled by a number only), one softmax, dropout and one mask addition, to the ``bmm`` of the
    scores; ``seen`` collects the softmax and the addition (with its mask). None: not attention."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        target = node.target
        if target is _BMM:
            return node if "softmax" in seen and "add" in seen else None
        if target in _SOFTMAX and "softmax" not in seen:
            seen["softmax"], node = node, node.args[0]
        elif target is _aten.add.Tensor and "add" not in seen and "softmax" in seen and len(node.args) == 2:
            for scores, mask in (node.args, node.args[::-1]):
                found = _trace_scores(scores, {**seen, "add": (node, mask)})
                if found is not None:
                    seen["add"] = (node, mask)
                    return found
            return None
        elif target is operator.getitem and getattr(node.args[0], "target", None) is _aten.native_dropout.default:
            node = node.args[0].args[0]
        elif target in _SCORE_STEPS and all(_scalar(a) or isinstance(a, (list, tuple)) for a in node.args[1:]):
            node = node.args[0]
        else:
            return None
    return None


def eager_attention(graph: torch.fx.Graph) -> dict[torch.fx.Node, EagerAttention]:
    """Every attention written as matrix products in ``graph``, by each of its two ``bmm`` nodes."""
    found: dict[torch.fx.Node, EagerAttention] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _BMM:
            seen: dict[str, Any] = {}
            scores = _trace_scores(node.args[0], seen)
            if scores is not None and isinstance(seen["add"][1], torch.fx.Node):
                attention = EagerAttention(scores, node, *seen["add"])
                found[scores] = found[node] = attention
    return found
