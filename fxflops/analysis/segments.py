"""Segment families: packed dimensions cut into variable-length pieces, found in the traced graph.

A varlen attention op receives cumulative offsets ``cu = [0, s₀, s₀+s₁, ...]``. Their values are data,
so no shape carries the lengths sᵢ; but work that is block-diagonal over the pieces costs
Σₖ cₖ·pₖ with power sums pₖ = Σᵢ sᵢᵏ, and those power sums are the runtime symbols.

This module follows how each offsets tensor is made, by abstract interpretation of the graph slice
that computes it from the call's integer inputs. Each value in that slice is one of:

* :class:`Table` — a 2-D integer input, e.g. ``image_grid_thw`` (N, 3);
* :class:`Rows` — a 1-D tensor whose element *i* is ``expr`` of row *i*'s columns ``c0, c1, ...``
  (``grid[:, 1] * grid[:, 2]`` is ``Rows(grid, c1*c2)``); ``diff=True`` reads consecutive differences
  of a 1-D input (the lengths of a given ``cu_seqlens``);
* :class:`Repeat` — ``repeat_interleave(r)``: row *i* repeated ``r_i`` times (as indices);
* :class:`Lengths` — a multiset of segment lengths: value ``values_i`` with multiplicity
  ``weights_i`` (``index_select(v, 0, repeat_interleave(r))`` — one segment per video frame);
* :class:`Cumulative` / :class:`Offsets` — ``cumsum`` of lengths, and that with a leading 0.

So a family is ``Lengths(values, weights)`` over one input, and pₖ = Σ_rows weights·valuesᵏ is
computed from the input tensor alone, with tensor ops on its own device (no ``repeat_interleave``,
whose output size would need a host sync). Two offsets tensors built the same way are one family.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

from fxflops.capture.derived import RowSum, column
from fxflops.capture.graph import op_name
from fxflops.capture.inputs import Path, path_label

ELEMENT = sympy.Symbol("x", integer=True)  # the element of a 1-D input


@dataclass(frozen=True)
class Table:
    source: Path
    columns: int | None  # None when the column count is itself a symbol (never read: that would guard)


@dataclass(frozen=True)
class Rows:
    source: Path
    expr: sympy.Expr
    diff: bool = False


@dataclass(frozen=True)
class Repeat:
    repeats: Rows


@dataclass(frozen=True)
class Lengths:
    """Segment lengths: ``values`` with multiplicity ``weights`` (``None``: each once)."""

    values: Rows
    weights: Rows | None = None


@dataclass(frozen=True)
class Cumulative:
    lengths: Lengths


@dataclass(frozen=True)
class Offsets:
    lengths: Lengths


@dataclass
class Family:
    """One segment family: its lengths, its public name and the statistics rules asked for."""

    lengths: Lengths
    name: str
    packed: set[sympy.Expr] = field(default_factory=set)  # packed lengths it cuts (segments fit in)
    covered: set[sympy.Expr] = field(default_factory=set)  # packed lengths it must cover exactly
    conditions: set[sympy.Expr] = field(default_factory=set)  # bounds on ELEMENT every segment meets

    @property
    def source(self) -> Path:
        return self.lengths.values.source

    def power_sum(self, k: int) -> sympy.Symbol:
        """pₖ = Σᵢ sᵢᵏ of this family, a nonnegative integer symbol named ``<family>_p<k>``."""
        return sympy.Symbol(f"{self.name}_p{k}", integer=True, nonnegative=True)

    def describe(self) -> str:
        """In words: which lengths this family's segments have, from which input."""
        v, w = self.lengths.values, self.lengths.weights
        label = path_label(v.source)
        if v.diff:
            return f"the segments cut by offsets {label}"
        columns = {column(j): sympy.Symbol(f"{label}[:, {j}]") for j in range(64)} | {ELEMENT: sympy.Symbol(label)}
        lengths = f"segments of length {v.expr.xreplace(columns)}"
        return lengths + ("" if w is None else f", {w.expr.xreplace(columns)} of them") + f" per row of {label}"


def derived_family(size: RowSum) -> Family:
    """A derived size as a family of one length per row of its input, ``per_row`` (unweighted): the
    size is that family's p₁, which the binder computes as it computes any power sum."""
    return Family(Lengths(Rows(size.source, size.per_row)), size.name)


class SegmentLengths:
    """What a varlen rule receives for an offsets argument: the family's power sums.

    ``lengths.power_sum(k)`` is pₖ = Σᵢ sᵢᵏ; ``lengths.packed(total)`` records the packed length the
    offsets cut (for metadata validation).
    """

    def __init__(self, family: Family, requested: set[tuple[str, int]]) -> None:
        self.family = family
        self._requested = requested

    def power_sum(self, k: int) -> sympy.Symbol:
        self._requested.add((self.family.name, k))
        return self.family.power_sum(k)

    def packed(self, total: Any) -> None:
        self.family.packed.add(sympy.sympify(total))

    def requires(self, condition: sympy.Expr) -> None:
        """Record a bound every segment length must meet, in ``ELEMENT`` (a lifted module's guard)."""
        self.family.conditions.add(condition)

    def covers(self, total: Any) -> None:
        """Record that the segments must cover a packed length exactly (per-segment lifting)."""
        self.family.covered.add(sympy.sympify(total))


_ELEMENTWISE = {
    "mul": operator.mul,
    "add": operator.add,
    "sub": operator.sub,
    "floor_divide": FloorDiv,
}
_RESHAPES = {"view", "_unsafe_view", "reshape", "expand", "expand_copy"}
_IDENTITY = {"_to_copy", "to", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_assert_tensor_metadata"}


def _is_vector(node: torch.fx.Node) -> bool:
    """The node's result is 1-d with as many elements as its input (a reshape that changes nothing)."""
    out, source = node.meta.get("val"), node.args[0].meta.get("val")
    return (
        isinstance(out, torch.Tensor)
        and isinstance(source, torch.Tensor)
        and out.dim() == 1
        and source.dim() == 1
        and _size_expr(out.shape[0]) == _size_expr(source.shape[0])  # structural: no guard
    )


def _size_expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _combine(name: str, a: Any, b: Any) -> Rows | None:
    """Elementwise ``a op b`` of Rows over one source (or with a Python number)."""
    op = _ELEMENTWISE[name]
    if isinstance(a, Rows) and isinstance(b, Rows):
        if (a.source, a.diff) != (b.source, b.diff):
            return None
        return Rows(a.source, op(a.expr, b.expr), a.diff)
    if isinstance(a, Rows) and isinstance(b, int):
        return Rows(a.source, op(a.expr, b), a.diff)
    if isinstance(b, Rows) and isinstance(a, int) and name in ("mul", "add"):
        return Rows(b.source, op(a, b.expr), b.diff)
    return None


def _transfer(node: torch.fx.Node, value: dict[torch.fx.Node, Any]) -> Any:
    """The abstract value of ``node`` from its inputs' (``None`` where it cannot be followed)."""
    name = op_name(node.target)
    args = [value.get(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
    first = args[0] if args else None
    if name in _IDENTITY:
        return first
    if name in _RESHAPES and isinstance(first, Rows) and _is_vector(node):  # [n] -> [n]: the same rows
        return first
    if name == "slice" and isinstance(first, Table) and args[1] == 0 and args[2] in (0, None) and len(args) > 3 and args[3] >= 2**62:
        return first
    if name == "select" and isinstance(first, Table) and args[1] == 1:
        return Rows(first.source, column(args[2]))
    if name == "prod" and isinstance(first, Table) and first.columns is not None and args[1] in (1, -1):
        return Rows(first.source, sympy.Mul(*(column(j) for j in range(first.columns))))
    if name in _ELEMENTWISE and len(args) >= 2:
        return _combine(name, first, args[1])
    if name == "div" and node.kwargs.get("rounding_mode") == "floor":
        return _combine("floor_divide", first, args[1])
    if name == "repeat_interleave" and isinstance(first, Rows) and len(args) == 1:
        return Repeat(first)
    if name == "repeat_interleave" and isinstance(first, Rows) and isinstance(args[1], Rows):
        return Lengths(first, args[1]) if first.source == args[1].source else None
    if name == "index_select" and isinstance(first, Rows) and args[1] == 0 and isinstance(args[2], Repeat):
        return Lengths(first, args[2].repeats) if first.source == args[2].repeats.source else None
    if name == "cumsum" and args[1] == 0:
        if isinstance(first, Lengths):
            return Cumulative(first)
        if isinstance(first, Rows):
            return Cumulative(Lengths(first))
    if name == "constant_pad_nd" and isinstance(first, Cumulative) and list(args[1]) == [1, 0] and (len(args) < 3 or args[2] == 0):
        return Offsets(first.lengths)
    return None


class SegmentAnalysis:
    """Abstract values of a captured graph's metadata slice and the families found there."""

    def __init__(self, graph: torch.fx.Graph, placeholders: dict[torch.fx.Node, Path], names: dict[str, str]) -> None:
        """``placeholders``: graph input node -> input path; ``names``: input label -> family name."""
        self.value: dict[torch.fx.Node, Any] = {}
        self.families: dict[Lengths, Family] = {}
        self.requested: set[tuple[str, int]] = set()
        self._names = names
        for node in graph.nodes:
            if node.op == "placeholder" and node in placeholders:
                fake = node.meta.get("val")
                if isinstance(fake, torch.Tensor) and not fake.dtype.is_floating_point and fake.dim() in (1, 2):
                    path = placeholders[node]
                    width = fake.shape[-1]
                    self.value[node] = (
                        Rows(path, ELEMENT) if fake.dim() == 1 else Table(path, width if isinstance(width, int) else None)
                    )
            elif node.op == "call_function" and any(
                isinstance(a, torch.fx.Node) and a in self.value for a in node.args
            ):
                abstract = _transfer(node, self.value)
                if abstract is not None:
                    self.value[node] = abstract

    @classmethod
    def empty(cls) -> SegmentAnalysis:
        """An analysis that knows no offsets (for graphs with no metadata inputs)."""
        return cls(torch.fx.Graph(), {}, {})

    def symbols(self) -> set[sympy.Symbol]:
        """The power-sum symbols rules asked for so far."""
        by_name = {f.name: f for f in self.families.values()}
        return {by_name[name].power_sum(k) for name, k in self.requested}

    def lengths_of(self, node: Any, where: str) -> SegmentLengths:
        """The segment family of an offsets argument; ``where`` names op and module for errors."""
        abstract = self.value.get(node) if isinstance(node, torch.fx.Node) else None
        if isinstance(abstract, Rows) and abstract.expr == ELEMENT and not abstract.diff:
            abstract = Offsets(Lengths(Rows(abstract.source, ELEMENT, diff=True)))  # a cu input
        if not isinstance(abstract, Offsets):
            made_by = node.target if isinstance(node, torch.fx.Node) else type(node).__name__
            raise ValueError(
                f"{where}: cannot tell the segment lengths of its offsets argument (made by {made_by}); "
                "fxflops follows offsets that are a call input or are built from one with "
                "repeat_interleave / cumsum / pad and elementwise integer math"
            )
        family = self.families.get(abstract.lengths)
        if family is None:
            base = self._names.get(path_label(abstract.lengths.values.source), path_label(abstract.lengths.values.source))
            taken = {f.name for f in self.families.values()}
            name, i = base, 2
            while name in taken:
                name, i = f"{base}_{i}", i + 1
            family = self.families[abstract.lengths] = Family(abstract.lengths, name)
        return SegmentLengths(family, self.requested)
