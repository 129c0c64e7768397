"""The per-node pass: every op of a traced graph -> the :class:`Term` its FLOPs rule gives.

Written like ``torch.fx.Interpreter``: :meth:`NodeRules.run` visits the graph's nodes in order and
:meth:`NodeRules.run_node` dispatches each ``call_function`` node to one method per kind of node —
:meth:`~NodeRules.marker` (work the capture left as a marker, ``capture/markers.py``),
:meth:`~NodeRules.with_rule` (the op's registered rule on its traced shapes) or
:meth:`~NodeRules.without_rule` (elementwise arithmetic, ops that are not counted, or an unsupported
op). Shapes reach a rule as tuples of sympy expressions in the public symbols (``named``); a varlen
op's offsets as their segment family (``analysis/segments.py``). Backward nodes belong to the module
of the forward op they differentiate (the same autograd sequence number).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fxflops.analysis.lifted import per_segment_terms
from fxflops.analysis.masks import (
    CausalMask, KeptPairs, MaskReader, eager_attention, given_arguments, is_causal, mask_argument, mask_notes, pairs_kept,
    read_causal, unread_eager_note, whole_blocks,
)
from fxflops.analysis.moe import expert_modules, routed_rows_as_pairs, router_nodes
from fxflops.analysis.paths import inside, join, module_path
from fxflops.analysis.segments import ELEMENT, SegmentAnalysis
from fxflops.analysis.terms import Term, Unsupported
from fxflops.capture.inputs import Path, path_label
from fxflops.capture.lifting import SEGMENT, Lifted
from fxflops.capture.markers import is_marker, segment_backward_call, segment_output
from fxflops.capture.phases import phase_of
from fxflops.errors import CaptureError
from fxflops.rules import Entry, entry_for, segment_args
from fxflops.rules.elementwise import elementwise_flops
from fxflops.rules.not_counted import is_not_counted, touches_floats


@dataclass(frozen=True)
class NodeTerms:
    """What the pass found: terms, floating ops without a rule, and notes on how some were counted."""

    terms: list[Term]
    unsupported: list[Unsupported]
    notes: list[str]
    kept_pairs: dict[sympy.Symbol, KeptPairs]  # runtime statistics of masks read from the graph


def as_rule_argument(value: Any, named: Callable[[Any], sympy.Expr]) -> Any:
    """An FX argument as rules see it: tensors -> shape tuples, SymInts -> sympy, rest unchanged."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return tuple(named(s) for s in value.shape)
    if isinstance(value, torch.SymInt):
        return named(value)
    if isinstance(value, (list, tuple)):
        return type(value)(as_rule_argument(v, named) for v in value)
    return value


def _traced_values(value: Any) -> Any:
    """The node argument(s) as their traced values (FakeTensors), for dtype checks."""
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return [_traced_values(v) for v in value]
    return value


def _static_dims(args: list) -> tuple[int, ...]:
    """The static sizes (> 1) of the shapes among a rule's arguments, sorted."""
    shapes = [a for a in args if isinstance(a, tuple)]
    return tuple(sorted({int(d) for shape in shapes for d in shape if isinstance(d, (int, sympy.Integer)) and d > 1}))


def _forward_modules(graph: torch.fx.Graph) -> dict[int, str]:
    """Autograd sequence number -> the module of the first forward node with it (the op recorded)."""
    found: dict[int, str] = {}
    for node in graph.nodes:
        if node.op == "call_function" and phase_of(node) == "fwd" and "seq_nr" in node.meta:
            found.setdefault(node.meta["seq_nr"], module_path(node))
    return found


def _split_recompute(term: Term, entry: Entry, args: list, kwargs: dict, out_shape: Any) -> list[Term]:
    """A backward term whose rule recomputes forward work (``Entry.recomputed``), as a ``bwd`` term
    and a ``recompute`` term holding that share of its FLOPs (and of its exact-causal FLOPs)."""
    if entry.recomputed is None or term.phase != "bwd":
        return [term]
    share = sympy.sympify(entry.recomputed(*args, out_shape=out_shape, **kwargs))

    def again(flops: sympy.Expr | None) -> sympy.Expr | None:
        return None if flops is None else sympy.expand(flops * share)

    def rest(flops: sympy.Expr | None) -> sympy.Expr | None:
        return None if flops is None else sympy.expand(flops - flops * share)

    return [
        replace(term, flops=rest(term.flops), causal_exact=rest(term.causal_exact), causal_half=rest(term.causal_half)),
        replace(term, node=f"{term.node}.recompute", phase="recompute", flops=again(term.flops),
                causal_exact=again(term.causal_exact), causal_half=again(term.causal_half)),
    ]


def _described(mask: CausalMask) -> str:
    """How a read mask is counted, for the program's notes."""
    runs = "" if mask.runs is None else f" inside the runs of consecutive {path_label(mask.runs)} (packed sequences)"
    if mask.offset is None:
        return f"block-diagonal{runs}: each packed sequence attends to itself, the blocks counted under causal='exact' and 'half'"
    padding = "" if mask.padding is None else f" and padding from {path_label(mask.padding)}"
    window = "" if mask.window is None else f" with a sliding window of {mask.window} keys (causal='half' leaves it dense)"
    return f"causal{padding}{runs}{window}"


class NodeRules:
    """One pass over ``graph`` (see the module docstring). ``named`` maps a traced size to the public
    symbols and ``known`` holds them; ``lifted`` are the per-segment modules by path; ``prefix`` is
    the module path the graph's root sits at (a lifted module's own graph)."""

    def __init__(
        self,
        graph: torch.fx.Graph,
        named: Callable[[Any], sympy.Expr],
        known: set[sympy.Symbol],
        segments: SegmentAnalysis,
        lifted: dict[str, Lifted],
        prefix: str = "",
        placeholders: dict[torch.fx.Node, Path] | None = None,
    ) -> None:
        self.graph, self.named, self.segments, self.lifted, self.prefix = graph, named, segments, lifted, prefix
        self.known = known
        self.terms: list[Term] = []
        self.unsupported: list[Unsupported] = []
        self.notes: list[str] = []
        self.routers = router_nodes(graph)
        self.experts = expert_modules(graph)
        self.routed: dict[str, set[sympy.Symbol]] = {}  # expert module -> data-dependent group sizes in its FLOPs
        self.backward_calls = {segment_backward_call(n) for n in graph.nodes} - {None}
        self.forward_module = _forward_modules(graph)
        self.masks = MaskReader(placeholders or {}, named)
        self.eager = eager_attention(graph)  # attention as two bmm nodes, by each of them
        self.kept_pairs: dict[KeptPairs, sympy.Symbol] = {}

    def run(self) -> NodeTerms:
        for node in self.graph.nodes:
            if node.op == "call_function" and node.target is not operator.getitem:
                self.run_node(node)
        if self.routed:
            pairs = {join(self.prefix, e): sympy.expand(self.named(math.prod(i.meta["val"].shape))) for e, i in self.experts.items()}
            self.terms = routed_rows_as_pairs(self.terms, self.routed, pairs)
        return NodeTerms(self.terms, self.unsupported, self.notes, {sym: pairs for pairs, sym in self.kept_pairs.items()})

    def run_node(self, node: torch.fx.Node) -> None:
        phase = phase_of(node)
        own = self.forward_module.get(node.meta.get("seq_nr"), "") if phase == "bwd" else module_path(node)
        if is_marker(node):
            return self.marker(node, join(self.prefix, own), phase)
        entry = entry_for(node.target)
        if entry is None:
            return self.without_rule(node, join(self.prefix, own), phase)
        return self.with_rule(node, own, phase, entry)

    def marker(self, node: torch.fx.Node, path: str, phase: str) -> None:
        """A per-segment module's call, billed at the output that carries it (its backward, from its
        own one-segment joint trace, where its gradient marker shows it ran). Repeated layers' markers
        are billed after the pass (``analysis/lifted.py``)."""
        output = segment_output(node)
        if output is None or not output.bills:
            return
        where = f"{node.target} in module {path or '<root>'!r}"
        lifted = self.lifted[module_path(node)]
        try:
            lengths = self.segments.lengths_of(output.offsets, where)
        except ValueError as exc:
            raise CaptureError(str(exc)) from exc
        lengths.covers(self.named(output.packed.meta["val"].shape[0]))
        for condition in lifted.conditions:
            lengths.requires(condition.xreplace({SEGMENT: ELEMENT}))
        inner = NodeRules(lifted.graph_module.graph, lifted.in_s, {SEGMENT}, SegmentAnalysis.empty(), {}, path).run()
        if inner.unsupported:
            raise CaptureError(f"per-segment module {path!r} runs ops without a FLOPs rule: {sorted({u.op for u in inner.unsupported})}")
        self.terms += per_segment_terms(node.name, inner.terms, lengths, phase, output.call in self.backward_calls)

    def without_rule(self, node: torch.fx.Node, path: str, phase: str) -> None:
        """Elementwise arithmetic on floats (counted under ``count="all"``), an op that does no
        floating-point work, or a floating op with no rule (listed in ``program.unsupported``)."""
        op = node.target
        inputs = [_traced_values(a) for a in (*node.args, *node.kwargs.values())]
        floating = touches_floats(inputs, node.meta.get("val"))
        elementwise = elementwise_flops(op, node, self.named) if floating else None
        if elementwise is not None:
            if elementwise.free_symbols - self.known - self.segments.symbols():  # sizes only data gives
                self.notes.append(f"{path or '<root>'}: elementwise {op} works on data-dependent sizes; not counted even under count='all'")
            elif elementwise != 0:
                self.terms.append(Term(node.name, str(op), path, phase, elementwise, kind="elementwise"))
        elif isinstance(op, torch._ops.OpOverload | torch._ops.HigherOrderOperator) and not is_not_counted(op) and floating:
            self.unsupported.append(Unsupported(node.name, str(op), path))

    def with_rule(self, node: torch.fx.Node, own: str, phase: str, entry: Entry) -> None:
        """The op's rule on its traced shapes: dense FLOPs, and the exact count of a causal call."""
        path = join(self.prefix, own)
        args = [as_rule_argument(a, self.named) for a in node.args]
        kwargs = {k: as_rule_argument(v, self.named) for k, v in node.kwargs.items()}
        out_shape = as_rule_argument(node.meta.get("val"), self.named)
        flops, exact = self._apply(entry, node, path, args, kwargs, out_shape)
        attention = entry.causal is not None or node in self.eager
        masked = self._read_mask(node, path, flops) if attention and exact is None else None
        exact, half = masked if masked is not None else (exact, None)
        unknown = (flops.free_symbols | (exact.free_symbols if exact is not None else set())) - self.known - self.segments.symbols()
        unknown -= set(self.kept_pairs.values())
        if unknown:
            self._data_dependent(node, own, path, unknown)
        if flops != 0:
            term = Term(node.name, str(node.target), path, phase, flops, entry.kind, exact, node in self.routers, _static_dims(args), half)
            self.terms += _split_recompute(term, entry, args, kwargs, out_shape)
            if masked is None:
                self.notes += mask_notes(node, path)
                if node in self.eager and node is self.eager[node].scores:
                    self.notes.append(unread_eager_note(path))

    def _apply(
        self, entry: Entry, node: torch.fx.Node, path: str, args: list, kwargs: dict, out_shape: Any
    ) -> tuple[sympy.Expr, sympy.Expr | None]:
        """The rule's dense and exact-causal FLOPs; a rule that fails names the node and module."""
        causal = entry.causal is not None and is_causal(node)
        try:
            self._with_segments(node, path, args, kwargs)
            flops = sympy.expand(sympy.sympify(entry.rule(*args, out_shape=out_shape, **kwargs)))
            exact = entry.causal(*args, out_shape=out_shape, **kwargs) if causal else None
        except Exception as exc:  # a rule refusing its input (e.g. paged attention) names itself
            raise CaptureError(
                f"FLOPs rule for {node.target} in module {path or '<root>'!r} failed: {exc}\n"
                f"While analysing graph node {node.format_node()}"
            ) from exc
        if causal and exact is None:
            self.notes.append(f"{path or '<root>'}: causal {node.target} with query and key lengths that differ is counted dense under every convention")
        return flops, None if exact is None else sympy.expand(sympy.sympify(exact))

    def _read_mask(self, node: torch.fx.Node, path: str, flops: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr | None] | None:
        """:meth:`_masked_causal` (the exact FLOPs and ``Term.causal_half``), or None
        (counted dense, noted) when reading the mask fails: reading it is a refinement, never a reason
        to refuse the capture."""
        try:
            return self._masked_causal(node, path, flops)
        except Exception:  # noqa: BLE001 - an unusual mask graph: left unread
            return None

    def _masked_causal(self, node: torch.fx.Node, path: str, flops: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr | None] | None:
        """The exact FLOPs of an attention op, or of either product of an attention written as matrix
        products (``masks.eager_attention``), given a mask built in the graph: ``_kept``."""
        if node in self.eager:
            attention = self.eager[node]
            scores = as_rule_argument(attention.add, self.named)  # (B, H, Q, K)
            kept = self._kept(attention.mask, path, flops, scores[0], scores[2], scores[3]) if len(scores) == 4 else None
            if kept is not None and node is attention.scores:
                self.notes.append(f"{path or '<root>'}: attention as matrix products (eager): both products counted as causal; "
                                  "the products of a traced backward stay dense (backward='2x' conventions scale the forward)")
            return kept
        mask, given = mask_argument(node), given_arguments(node)
        if mask is None or is_causal(node) or not all(isinstance(given.get(n), torch.fx.Node) for n in ("query", "key")):
            return None
        query, key = (as_rule_argument(given[n], self.named) for n in ("query", "key"))
        return self._kept(mask, path, flops, query[0], query[2], key[2]) if len(query) == len(key) == 4 else None

    def _kept(
        self, mask: torch.fx.Node, path: str, flops: sympy.Expr, batch: sympy.Expr, queries: sympy.Expr, keys: sympy.Expr
    ) -> tuple[sympy.Expr, sympy.Expr | None] | None:
        """Attention over ``batch`` x ``queries`` x ``keys`` given ``mask``: when the mask is read
        (causal, with or without padding or a sliding window, or inside packed sequences,
        ``masks.py``), the dense FLOPs, which are the same per (batch, query, key) triple, times the
        triples the mask keeps over B·Q·K; and ``Term.causal_half``: a window is not halved (dense),
        packed sequences halve their blocks (Σᵢ sᵢ²/2), a bidirectional block mask counts its blocks.
        None when the mask is not read."""
        causal = read_causal(self.masks, mask)
        if causal is None:
            return None
        shape = as_rule_argument(mask, self.named)  # the mask spans queries and keys (and rows, with padding)
        # one mask row broadcast over every query row (a decode step whose query heads SDPA folds
        # into the query dim): each row keeps that row's keys, the triples are Q x those of the row
        seen = 1 if sympy.expand(shape[-2] - 1) == 0 and causal.runs is None else queries
        spans = [(shape[-2], seen), (shape[-1], keys)] + ([(shape[0], batch)] if causal.padding is not None else [])
        if causal.runs is not None:  # one positions row gives both the queries' and the keys' runs
            spans.append((queries, keys))
        if any(sympy.expand(a - b) != 0 for a, b in spans):
            return None
        pairs = pairs_kept(causal, batch, seen, keys)
        per_row = sympy.cancel(flops / (batch * seen * keys))  # FLOPs per (batch, mask row, key)
        if pairs is None or sympy.fraction(per_row)[1].free_symbols:
            return None
        blocks = self._statistic(whole_blocks(causal, batch, seen, keys))
        kept = self._statistic(pairs) if causal.offset is not None else blocks
        halved = causal.offset is not None and causal.window is None
        half = None if causal.runs is None and halved else sympy.expand(per_row * blocks / (2 if halved else 1))
        self.notes.append(f"{path or '<root>'}: an attention mask is read from the graph as {_described(causal)}")
        return sympy.expand(per_row * kept), half

    def _statistic(self, pairs: KeptPairs | sympy.Expr) -> sympy.Expr:
        """The runtime symbol of a kept-pairs statistic (one per input and shape); a polynomial as it is."""
        if not isinstance(pairs, KeptPairs):
            return pairs
        if pairs not in self.kept_pairs:
            source = pairs.padding if pairs.padding is not None else pairs.runs
            kind = "block_pairs" if pairs.offset is None else "kept_pairs"
            base = f"{path_label(source)}_{kind}" if source is not None else "window_kept_pairs"
            taken = {str(s) for s in self.kept_pairs.values()}
            name = base if base not in taken else f"{base}_{len(taken) + 1}"
            self.kept_pairs[pairs] = sympy.Symbol(name, integer=True, nonnegative=True)
        return self.kept_pairs[pairs]

    def _with_segments(self, node: torch.fx.Node, path: str, args: list, kwargs: dict) -> None:
        """Replace the offsets arguments of a varlen op (``segment_args``) by their segment families."""
        op = node.target
        names = [a.name for a in op._schema.arguments] if hasattr(op, "_schema") else []
        where = f"{op} in module {path or '<root>'!r}"
        for spec in segment_args(op):
            index = spec if isinstance(spec, int) else names.index(spec)
            if index < len(node.args):
                if node.args[index] is not None:
                    args[index] = self.segments.lengths_of(node.args[index], where)
            elif index < len(names) and node.kwargs.get(names[index]) is not None:
                kwargs[names[index]] = self.segments.lengths_of(node.kwargs[names[index]], where)

    def _data_dependent(self, node: torch.fx.Node, own: str, path: str, unknown: set[sympy.Symbol]) -> None:
        """Sizes no input shape or segment family gives: an expert dispatch's token groups (summed to
        the (token, expert) pairs after the pass), else a refusal."""
        expert = next((e for e in self.experts if inside(own, e)), None)
        if expert is not None and all(free_unbacked_symbols(u) for u in unknown):
            self.routed.setdefault(join(self.prefix, expert), set()).update(unknown)
            return
        origin = self._origin(unknown)
        made = "" if origin is None else f" (made in module {join(self.prefix, module_path(origin)) or '<root>'!r} by {origin.target})"
        raise CaptureError(
            f"the FLOPs of {node.target} in module {path or '<root>'!r} depend on data-dependent size(s) "
            f"{sorted(map(str, unknown))}{made} that no input shape or segment family gives",
            module=path if origin is None else join(self.prefix, module_path(origin)),
        )

    def _origin(self, unknown: set[sympy.Symbol]) -> torch.fx.Node | None:
        """The first node whose output has one of the data-dependent sizes ``unknown`` (the op that
        made it: a boolean-mask index, a nonzero, an ``.item()``), or None."""
        names = {str(u) for u in unknown}
        for node in self.graph.nodes:
            val = node.meta.get("val")
            sizes = val.shape if isinstance(val, torch.Tensor) else (val,) if isinstance(val, torch.SymInt) else ()
            for size in sizes:
                if isinstance(size, torch.SymInt) and names & {str(s) for s in size.node.expr.free_symbols}:
                    return node
        return None
