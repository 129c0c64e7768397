"""Program: the traced model's FLOPs as exact polynomials per graph node and per module.

Built from a :class:`~fxflops.capture.trace.Captured` graph: every node gets a :class:`Term` from its
rule (module path from ``nn_module_stack``, phase, sympy expression in the named symbols). Terms roll
up into the module tree of ``model.named_modules()``; a module called twice sums both calls.

Evaluation uses a monomial basis: every module/phase total is a linear combination ``C · m(x)`` of a few
monomials ``m(x)`` (``seq``, ``seq**2``, ``batch*seq``, ...). A call evaluates ``m(x)`` once (cost
independent of the number of modules) and any breakdown is a dot product at read time. Coefficients are
scaled by their common denominator so that everything stays in exact Python integers.
"""

from __future__ import annotations

import json
import math
import operator
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx
import sympy
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fxflops.binder import VALID, Binder, generated, python_source
from fxflops.call_keys import CallKeys
from fxflops.capture.adapters import Adapter
from fxflops.capture.inputs import path_label
import fxflops.capture.reuse  # noqa: F401 - registers fxflops::repeat_layer
from fxflops.capture.lifting import SEGMENT, Lifted
from fxflops.capture.phases import phase_of
from fxflops.capture.segments import ELEMENT, Family, SegmentAnalysis, op_name
from fxflops.capture.trace import Captured, Guard
from fxflops.conventions import FLOPCOUNTER, Convention
from fxflops.errors import CaptureError, GuardError, InputError, MetadataError, UnboundSymbolError
from fxflops.rules import entry_for, segment_args
from fxflops.rules.elementwise import elementwise_flops
from fxflops.rules.not_counted import is_not_counted, touches_floats
from fxflops.situation import ModelState, describe_difference

PHASES = ("fwd", "bwd", "recompute")
_CALLS, _MEASURED = sympy.Symbol("calls"), sympy.Symbol("measured_calls")  # bookkeeping columns of MoE programs
BACKWARD_RULES = ("none", "traced", "2x")
PER_SEGMENT = torch.ops.fxflops.per_segment.default
PER_SEGMENT_GRAD = torch.ops.fxflops.per_segment_grad.default
REPEAT, REPEAT_GRAD = torch.ops.fxflops.repeat_layer.default, torch.ops.fxflops.repeat_layer_grad.default


def backward_rule(backward: bool | str) -> str:
    """``False`` -> ``"none"``, ``True`` -> ``"traced"``; ``"traced"``/``"2x"``/``"none"`` as they are."""
    if isinstance(backward, bool):
        return "traced" if backward else "none"
    return backward


@dataclass(frozen=True)
class Term:
    """The FLOPs of one graph node: ``flops`` (sympy) done by ``op`` inside module ``module``.

    ``kind`` is the rule's kind (``matmul``, ``elementwise``, ``embedding``: which conventions count
    it); ``causal_exact`` the exact count of a causal attention call (``flops`` is the dense count).
    """

    node: str
    op: str
    module: str
    phase: str
    flops: sympy.Expr
    kind: str = "matmul"
    causal_exact: sympy.Expr | None = None
    router: bool = False  # a mixture-of-experts router GEMM (or its backward): see ``router_nodes``


@dataclass(frozen=True)
class Unsupported:
    """A floating-point op with no rule: its work is unknown, so totals are lower bounds."""

    node: str
    op: str
    module: str

    def __str__(self) -> str:
        return f"{self.op} (graph node {self.node}) in module {self.module or '<root>'!r}"


_DYNAMO_ROOT = "L['self']"


def module_path(node: torch.fx.Node) -> str:
    """The path of the innermost ``nn.Module`` the node ran in (``""`` = the root). Dynamo names the
    root ``L['self']`` (``L['self'].layers.0.attn``); that prefix is dropped."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]
    if path.startswith(_DYNAMO_ROOT):
        path = path[len(_DYNAMO_ROOT) :].lstrip(".")
    return path


def _as_rule_argument(value: Any, named: Callable[[Any], sympy.Expr]) -> Any:
    """An FX argument as rules see it: tensors -> shape tuples, SymInts -> sympy, rest unchanged."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return tuple(named(s) for s in value.shape)
    if isinstance(value, torch.SymInt):
        return named(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_as_rule_argument(v, named) for v in value)
    return value


def _tensor_values(value: Any) -> Any:
    """The node argument(s) as their traced values (FakeTensors), for dtype checks."""
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return [_tensor_values(v) for v in value]
    return value


def _with_segments(node: torch.fx.Node, args: list, kwargs: dict, segments: SegmentAnalysis) -> None:
    """Replace the offsets arguments of a varlen op (``segment_args``) by their segment families."""
    op = node.target
    names = [a.name for a in op._schema.arguments] if hasattr(op, "_schema") else []
    where = f"{op} in module {module_path(node) or '<root>'!r}"
    for spec in segment_args(op):
        index = spec if isinstance(spec, int) else names.index(spec)
        if index < len(node.args):
            if node.args[index] is not None:
                args[index] = segments.lengths_of(node.args[index], where)
        elif index < len(names) and node.kwargs.get(names[index]) is not None:
            kwargs[names[index]] = segments.lengths_of(node.kwargs[names[index]], where)


def _join(prefix: str, path: str) -> str:
    return ".".join(p for p in (prefix, path) if p)


def _graph_terms(
    graph: torch.fx.Graph,
    named: Callable[[Any], sympy.Expr],
    known: set[sympy.Symbol],
    segments: SegmentAnalysis,
    lifted: dict[str, Lifted],
    prefix: str = "",
) -> tuple[list[Term], list[Unsupported], list[str]]:
    """Apply the rule of every op node in ``graph`` (see the module docstring); ``named`` maps a
    traced size to the public symbols, ``prefix`` is the module path the graph's root sits at.
    Backward nodes belong to the module of the forward op they differentiate (same autograd
    sequence number). Returns terms, unsupported ops, and notes on how some ops were counted."""
    terms, unsupported, notes = [], [], []
    routers = router_nodes(graph)
    experts = expert_modules(graph)
    routed: dict[str, set[sympy.Symbol]] = {}  # expert module -> data-dependent group sizes in its FLOPs
    lifted_backward = {n.args[2] for n in graph.nodes if n.op == "call_function" and n.target is PER_SEGMENT_GRAD}
    forward_module: dict[int, str] = {}
    for node in graph.nodes:  # the first forward node of a sequence number is the op autograd recorded
        if node.op == "call_function" and phase_of(node) == "fwd" and "seq_nr" in node.meta:
            forward_module.setdefault(node.meta["seq_nr"], module_path(node))
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        phase = phase_of(node)
        own = forward_module.get(node.meta.get("seq_nr"), "") if phase == "bwd" else module_path(node)
        op, path = node.target, _join(prefix, own)
        where = f"{op} in module {path or '<root>'!r}"
        if op is PER_SEGMENT:
            if node.args[4]:  # the first output of a lifted module's call carries its FLOPs
                ran = node.args[5] in lifted_backward
                terms += _lifted_terms(node, path, where, named, segments, lifted[module_path(node)], phase, ran)
            continue
        if op is PER_SEGMENT_GRAD:  # its backward is billed from the one-segment joint trace
            continue
        if op in (REPEAT, REPEAT_GRAD):  # a reused layer: billed its template's terms (_repeated_terms)
            continue
        entry = entry_for(op)
        if entry is None:
            inputs = [_tensor_values(a) for a in (*node.args, *node.kwargs.values())]
            floating = touches_floats(inputs, node.meta.get("val"))
            elementwise = elementwise_flops(op, node, named) if floating else None
            if elementwise is not None:
                if elementwise.free_symbols - known - segments.symbols():  # sizes only data gives
                    notes.append(
                        f"{path or '<root>'}: elementwise {op} works on data-dependent sizes; not counted even under count='all'"
                    )
                elif elementwise != 0:
                    terms.append(Term(node.name, str(op), path, phase, elementwise, kind="elementwise"))
            elif (
                isinstance(op, torch._ops.OpOverload | torch._ops.HigherOrderOperator)
                and not is_not_counted(op)
                and floating
            ):
                unsupported.append(Unsupported(node.name, str(op), path))
            continue
        args = [_as_rule_argument(a, named) for a in node.args]
        kwargs = {k: _as_rule_argument(v, named) for k, v in node.kwargs.items()}
        out_shape = _as_rule_argument(node.meta.get("val"), named)
        try:
            _with_segments(node, args, kwargs, segments)
            flops = sympy.expand(sympy.sympify(entry.rule(*args, out_shape=out_shape, **kwargs)))
            exact = entry.causal(*args, out_shape=out_shape, **kwargs) if entry.causal and _is_causal(node) else None
        except Exception as exc:  # a rule refusing its input (e.g. paged attention) names itself
            raise CaptureError(f"FLOPs rule for {where} failed: {exc}") from exc
        if entry.causal and _is_causal(node) and exact is None:
            notes.append(f"{path or '<root>'}: causal {op} with query and key lengths that differ is counted dense under every convention")
        exact = None if exact is None else sympy.expand(sympy.sympify(exact))
        unknown = (flops.free_symbols | (exact.free_symbols if exact is not None else set())) - known - segments.symbols()
        expert = next((e for e in experts if own == e or own.startswith(e + ".")), None)
        if unknown and expert is not None and all(free_unbacked_symbols(u) for u in unknown):
            routed.setdefault(_join(prefix, expert), set()).update(unknown)  # token groups of a dispatch loop
        elif unknown:
            raise CaptureError(
                f"the FLOPs of {where} depend on data-dependent size(s) {sorted(map(str, unknown))} "
                "that no input shape or segment family gives"
            )
        if flops != 0:
            term = Term(node.name, str(op), path, phase, flops, entry.kind, exact, router=node in routers)
            terms += _split_recompute(term, entry, args, kwargs, out_shape)
            notes += _mask_notes(node, path)
    if routed:
        pairs = {_join(prefix, e): sympy.expand(named(math.prod(i.meta["val"].shape))) for e, i in experts.items()}
        terms = _routed_rows_as_pairs(terms, routed, pairs)
    return terms, unsupported, notes


_ROUTER_CHOICES = frozenset({"topk", "sort", "argsort"})


def router_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Mixture-of-experts router GEMMs: the matrix products whose result reaches a top-k (or sort)
    expert choice through no other matrix product (logits -> softmax/sigmoid/bias -> topk), with
    their backward nodes (the same autograd sequence number). Conventions that leave the router
    out (Megatron: "router GEMM not counted", FORMULAS.md §1) skip them."""
    def is_product(node: torch.fx.Node) -> bool:
        entry = entry_for(node.target) if node.op == "call_function" else None
        return entry is not None and entry.kind == "matmul"

    found: set[torch.fx.Node] = set()
    for choice in graph.nodes:
        if choice.op != "call_function" or op_name(choice.target) not in _ROUTER_CHOICES:
            continue
        stack, seen = [a for a in choice.all_input_nodes], set()
        while stack:
            node = stack.pop()
            if node in seen or node.op != "call_function":
                continue
            seen.add(node)
            if is_product(node):
                found.add(node)
            else:
                stack.extend(node.all_input_nodes)
    sequence = {n.meta["seq_nr"] for n in found if "seq_nr" in n.meta}
    found |= {n for n in graph.nodes if n.op == "call_function" and n.meta.get("seq_nr") in sequence and phase_of(n) == "bwd"}
    return found


def expert_modules(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    """Mixture-of-experts expert modules: per top-k expert choice, the innermost module that reads
    the chosen indices (the dispatch: HF ``experts(hidden, top_k_index, top_k_weights)``), with the
    indices node (its element count is the number of (token, expert) pairs)."""
    found: dict[str, torch.fx.Node] = {}
    for choice in graph.nodes:
        if choice.op != "call_function" or op_name(choice.target) != "topk" or phase_of(choice) != "fwd":
            continue
        for indices in (u for u in choice.users if u.target is operator.getitem and u.args[1] == 1):
            readers = [module_path(r) for r in indices.users]
            if readers:
                found.setdefault(max(readers, key=lambda path: path.count(".") + (path != "")), indices)
    return dict(sorted(found.items()))


def _routed_rows_as_pairs(terms: list[Term], routed: dict[str, set[sympy.Symbol]], pairs: dict[str, sympy.Expr]) -> list[Term]:
    """The ``model`` count of an expert module whose dispatch loops over the experts with
    data-dependent token groups (``rows = (expert == e).nonzero()``): each group's size is a
    data-dependent symbol uₑ, and a dropless dispatch gives Σₑ uₑ = the number of (token, expert)
    pairs. With experts of equal cost (every uₑ with the same coefficients), Σₑ c·uₑ = c·pairs,
    so each uₑ becomes pairs / E. Uneven experts have no ``model`` count: refused (measure them)."""
    for path, symbols in routed.items():
        signatures = {}
        for u in symbols:
            signatures[u] = sorted(
                (t.op, t.phase, str(sympy.expand(t.flops).coeff(u))) for t in terms if u in t.flops.free_symbols
            )
        if len({tuple(v) for v in signatures.values()}) > 1:
            raise CaptureError(
                f"expert module {path!r} gives its experts different costs per token, so top_k x tokens x "
                "expert cost (moe='model') is not defined; fxflops cannot count it from shapes"
            )
        share = {u: pairs[path] / len(symbols) for u in symbols}
        terms = [
            replace(t, flops=sympy.expand(t.flops.xreplace(share)),
                    causal_exact=None if t.causal_exact is None else sympy.expand(t.causal_exact.xreplace(share)))
            if t.flops.free_symbols & symbols else t
            for t in terms
        ]
    return terms


def _split_recompute(term: Term, entry: Any, args: list, kwargs: dict, out_shape: Any) -> list[Term]:
    """A backward term whose rule recomputes forward work (``Entry.recomputed``), as a ``bwd`` term
    and a ``recompute`` term holding that share of its FLOPs (and of its exact-causal FLOPs)."""
    if entry.recomputed is None or term.phase != "bwd":
        return [term]
    share = sympy.sympify(entry.recomputed(*args, out_shape=out_shape, **kwargs))
    again = sympy.expand(term.flops * share)
    again_exact = None if term.causal_exact is None else sympy.expand(term.causal_exact * share)
    rest_exact = None if term.causal_exact is None else sympy.expand(term.causal_exact - again_exact)
    return [
        replace(term, flops=sympy.expand(term.flops - again), causal_exact=rest_exact),
        replace(term, node=f"{term.node}.recompute", phase="recompute", flops=again, causal_exact=again_exact),
    ]


_MASK_ARGUMENTS = ("attn_mask", "attn_bias")
_CAUSAL_ARGUMENTS = ("is_causal", "causal")


def _given_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (positional and keyword)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return dict(node.kwargs)
    return dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)


def _is_causal(node: torch.fx.Node) -> bool:
    """True if an attention call says it is causal (``is_causal=True`` / varlen ``causal=True``)."""
    given = _given_arguments(node)
    return any(given.get(name) is True for name in _CAUSAL_ARGUMENTS)


def _mask_notes(node: torch.fx.Node, path: str) -> list[str]:
    """Attention given a mask fxflops cannot read (a dense mask tensor, a flex block mask) is counted
    as dense work, under every convention; say so."""
    if "flex_attention" in str(node.target):
        return [
            f"{path or '<root>'}: {node.target}'s score_mod and block mask are not read; counted dense under "
            "every convention (a causal block mask is not halved)"
        ]
    given = _given_arguments(node)
    return [
        f"{path or '<root>'}: {node.target} has a mask ({name}); counted as the dense work the kernel does, "
        "masked entries included (a block-diagonal mask over packed sequences costs (Σsᵢ)² here, not Σsᵢ²)"
        for name in _MASK_ARGUMENTS
        if isinstance(given.get(name), torch.fx.Node)
    ]


def _lifted_terms(
    marker: torch.fx.Node,
    path: str,
    where: str,
    named: Callable[[Any], sympy.Expr],
    segments: SegmentAnalysis,
    lifted: Lifted,
    phase: str = "fwd",
    backward_ran: bool = False,
) -> list[Term]:
    """A lifted module's single-segment terms P(s), billed as Σₖ cₖ·pₖ of its offsets' family: the
    forward in ``phase`` (where its markers are: ``fwd``, or ``recompute`` under activation
    checkpointing), the backward (and the recompute inside it) only if this call's backward ran."""
    try:
        lengths = segments.lengths_of(marker.args[1], where)
    except ValueError as exc:
        raise CaptureError(str(exc)) from exc
    lengths.covers(named(marker.args[0].meta["val"].shape[0]))
    for condition in lifted.conditions:
        lengths.requires(condition.xreplace({SEGMENT: ELEMENT}))
    inner, unsupported, _ = _graph_terms(
        lifted.graph_module.graph, lifted.in_s, {SEGMENT}, SegmentAnalysis.empty(), {}, path
    )
    if unsupported:
        raise CaptureError(f"per-segment module {path!r} runs ops without a FLOPs rule: {sorted({u.op for u in unsupported})}")

    def billed(flops: sympy.Expr, op: str, module: str) -> sympy.Expr:
        """P(s) summed over the segments: Σₖ cₖ·pₖ."""
        if not flops.free_symbols <= {SEGMENT} or not flops.is_polynomial(SEGMENT):
            raise CaptureError(
                f"the FLOPs of {op} in per-segment module {module!r} are not a polynomial in the segment length: {flops}"
            )
        coefficients = sympy.Poly(flops, SEGMENT).all_coeffs()[::-1]
        return sympy.expand(sum((c * lengths.power_sum(k) for k, c in enumerate(coefficients) if c != 0), sympy.Integer(0)))

    return [
        Term(
            f"{marker.name}.{t.node}",
            t.op,
            t.module,
            phase if t.phase == "fwd" else t.phase,
            billed(t.flops, t.op, t.module),
            t.kind,
            None if t.causal_exact is None else billed(t.causal_exact, t.op, t.module),
        )
        for t in inner
        if t.phase == "fwd" or backward_ran
    ]


def terms_of(captured: Captured, segments: SegmentAnalysis) -> tuple[list[Term], list[Unsupported], list[str]]:
    """Terms of every node of a capture, lifted per-segment modules and reused layers included."""
    terms, unsupported, notes = _graph_terms(
        captured.graph_module.graph, captured.named, set(captured.symbols.values()), segments, captured.lifted
    )
    return _repeated_terms(terms, captured), unsupported, notes


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _repeated_terms(terms: list[Term], captured: Captured) -> list[Term]:
    """Each reused layer (``capture/reuse.py``) billed its template's terms under its own path, in
    the passes autograd really ran it: the forward where its markers are, the backward and its
    recompute (checkpointing, a fused attention backward's Q·Kᵀ) only where its marker's backward
    ran. Inner layers first, so a template's own reused layers count."""
    phases: dict[str, set[str]] = defaultdict(set)
    for node in captured.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is REPEAT and phase_of(node) == "fwd":
            phases[node.args[-1]].add("fwd")
        elif node.op == "call_function" and node.target is REPEAT_GRAD:  # recompute runs in the backward pass
            phases[node.args[-1]].update(("bwd", "recompute"))
    for layer, template in sorted(captured.reused.items(), key=lambda item: -item[0].count(".")):
        copies = [
            replace(t, node=f"{t.node}@{layer}", module=layer + t.module[len(template):])
            for t in terms
            if _under(t.module, template) and t.phase in phases[layer]
        ]
        terms = terms + copies
    return terms


def _counted(terms: Iterable[Term], convention: Convention) -> Iterator[tuple[str, str, sympy.Expr]]:
    """(module, phase, FLOPs) of ``terms`` as ``convention`` counts them, term by term."""
    for term in terms:
        if (term.kind == "elementwise" and convention.count != "all") or (
            term.kind == "embedding" and not convention.embeddings
        ):
            continue
        if term.router and not convention.router:
            continue
        if (term.phase == "recompute" and not convention.recompute) or (
            term.phase == "bwd" and convention.backward == "2x"
        ):
            continue
        flops = term.flops
        if term.causal_exact is not None and convention.causal != "full":
            flops = term.causal_exact if convention.causal == "exact" else term.flops / 2
        if convention.unit == "macs":
            flops = flops / 2
        yield term.module, term.phase, flops
        if term.phase == "fwd" and convention.backward == "2x":
            yield term.module, "bwd", 2 * flops


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def _exact_int(value: Any) -> int:
    """A monomial value as a Python int (a 0-d tensor from device metadata is read: a sync)."""
    return int(value.item()) if isinstance(value, torch.Tensor) else value


_PROBES = (2, 3, 5, 7, 16, 100, 4097)


def _exactly(guard: sympy.Basic, symbols: tuple[sympy.Symbol, ...]) -> Callable[..., bool] | None:
    """None when the guard's printed Python (see ``binder.generated``) evaluates as sympy does at a
    few probe points; otherwise an exact evaluator by substitution (slower, but never wrong)."""
    names = {sym: f"v{i}" for i, sym in enumerate(symbols)}
    params = ", ".join(names.values())
    try:
        printed = generated(f"def guard({params}):\n    return bool({python_source(guard, names)})\n", "guard")["guard"]
    except Exception:  # noqa: BLE001 - a form the printer cannot write as Python
        printed = None
    for value in _PROBES:
        point = {sym: value for sym in symbols}
        expected = _substituted(guard, point)
        try:
            agrees = printed is not None and (expected is None or printed(*point.values()) == expected)
        except Exception:  # noqa: BLE001 - e.g. a name the printed form needs and the scope lacks
            agrees = False
        if not agrees:
            return lambda *values: bool(_substituted(guard, dict(zip(symbols, values))))
    return None


def _substituted(guard: sympy.Basic, point: dict) -> bool | None:
    """The guard's truth at ``point`` by sympy substitution (None if sympy cannot decide it)."""
    try:
        value = guard.xreplace({sym: sympy.Integer(v) for sym, v in point.items()})
        return bool(value) if value in (sympy.true, sympy.false) or isinstance(value, bool) else None
    except (TypeError, ValueError, ZeroDivisionError):
        return None


def _ancestors(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b", "a.b.c"]``."""
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


class Program:
    """Exact FLOPs polynomials of one traced model (one capture, one set of guards).

    Attributes: ``symbols`` (free sympy symbols, sorted by name: input dims and segment power sums
    ``<family>_p<k>``), ``families`` (segment families, see :meth:`describe_symbols`), ``terms`` (per
    node), ``unsupported`` (ops with no rule), ``guards`` (conditions the polynomials need), ``notes``
    (how some ops were counted, e.g. masked dense attention), ``tree`` (networkx DiGraph of module
    paths).
    """

    def __init__(
        self,
        terms: list[Term],
        unsupported: list[Unsupported],
        symbols: Iterable[sympy.Symbol],
        guards: list[Guard],
        module_paths: Iterable[str],
        binder: Binder,
        families: list[Family] = (),
        experts: Iterable[str] = (),
    ) -> None:
        self.terms = terms
        self.experts = tuple(experts)  # MoE expert modules (see ``expert_modules``)
        self.reused: dict[str, str] = {}
        self.notes: list[str] = []
        self.backward = "none"
        self.convention = FLOPCOUNTER
        self.families = list(families)
        self.unsupported = unsupported
        self.all_symbols = tuple(sorted(symbols, key=str))  # what the binder reads, in order
        self.guards = guards
        self.binder = binder
        self.prepare: Callable[[tuple, dict], tuple[tuple, dict]] = Adapter().prepare  # see capture/adapters.py
        self.situation: tuple | None = None  # (call key, mode key) of the traced call (fxflops/situation.py)
        self.call_keys = CallKeys(binder._forward)
        self.state: ModelState | None = None  # the model state it was traced in
        self.tree = nx.DiGraph()
        self.tree.add_node("")
        for path in [*module_paths, *(t.module for t in terms)]:
            chain = _ancestors(path)
            nx.add_path(self.tree, chain)
        self._compile()
        self.symbols = self.required_symbols()

    @classmethod
    def from_capture(
        cls,
        captured: Captured,
        model: torch.nn.Module | Callable[..., Any],
        segments: dict[str, str] | None = None,
        strict_metadata: bool = False,
        backward: str = "none",
    ) -> Program:
        """Rules applied to a capture. ``segments`` names segment families by input label
        (``{"cu_seqlens": "text"}``); ``strict_metadata`` also validates device metadata (a sync);
        ``backward`` says where backward terms come from: ``"traced"`` (the capture's own backward
        graph), ``"2x"`` (twice each forward term, the convention of formula-based tools: the
        program's default convention becomes FLOPCOUNTER with ``backward="2x"``) or ``"none"``."""
        if backward not in BACKWARD_RULES:
            raise ValueError(f"backward must be one of {BACKWARD_RULES}, not {backward!r}")
        graph = captured.graph_module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        analysis = SegmentAnalysis(graph, dict(zip(placeholders, captured.placeholder_paths)), segments or {})
        terms, unsupported, notes = terms_of(captured, analysis)
        if captured.assumptions() != captured.assumptions_at_capture:
            raise CaptureError("internal error: the FLOPs analysis added a guard on the traced sizes; please report")
        for op in sorted({u.op for u in unsupported}):
            where = sorted({u.module or "<root>" for u in unsupported if u.op == op})
            warnings.warn(
                f"fxflops: no FLOPs rule for {op} (in {', '.join(where)}); its work is not counted "
                "and program.unsupported lists it. Register one with fxflops.rules.register.",
                stacklevel=3,
            )
        by_name = {f.name: f for f in analysis.families.values()}
        stats = {by_name[name].power_sum(k): (by_name[name], k) for name, k in analysis.requested}
        # device metadata is checked on the device: a flag per family, and VALID, 0 for a malformed call
        flags = {name: sympy.Symbol(f"malformed_{path_label(by_name[name].source)}") for name in sorted({n for n, _ in analysis.requested})}
        symbols = tuple(sorted([*captured.symbols.values(), *stats, *flags.values(), *((VALID,) if flags else ())], key=str))
        forward = model.forward if isinstance(model, torch.nn.Module) else model
        binder = Binder(forward, captured.input_dims, symbols, stats, strict_metadata, flags)
        families = sorted({family.name: family for family, _ in stats.values()}.values(), key=lambda f: f.name)
        paths = (n for n, _ in model.named_modules()) if isinstance(model, torch.nn.Module) else ()
        experts = list(expert_modules(graph))
        experts += [layer + e[len(t):] for layer, t in captured.reused.items() for e in experts if _under(e, t)]
        program = cls(terms, unsupported, symbols, captured.guards, paths, binder, families, sorted(set(experts)))
        program.notes = list(dict.fromkeys(notes))
        program.reused = dict(captured.reused)  # layers billed as repeats of a traced layer (capture/reuse.py)
        program.backward = backward
        if isinstance(model, torch.nn.Module):  # the model state the trace depended on (fxflops/situation.py)
            program.state = ModelState(model, captured.reads, captured.copies, captured.grad, captured.constants())
        if backward == "2x":
            program.convention = FLOPCOUNTER.but(backward="2x")
        return program

    # ---- compilation to the monomial basis -------------------------------------------------
    def _convention_terms(self, convention: Convention) -> Iterator[tuple[str, str, sympy.Expr]]:
        """(module, phase, FLOPs) of every term as ``convention`` counts it (module docstring of
        ``fxflops.conventions``); under ``moe="actual"`` expert modules' products are measured."""
        actual = convention.moe == "actual" and bool(self.experts)
        terms = [t for t in self.terms if not (actual and t.kind == "matmul" and self._expert_of(t.module) is not None)]
        yield from _counted(terms, convention)
        if actual:
            yield from self._measured_expert_terms(convention)

    def _expert_of(self, module: str) -> int | None:
        """Index of the expert module ``module`` is (or is inside), else None."""
        for i, path in enumerate(self.experts):
            if module == path or module.startswith(path + "."):
                return i
        return None

    def _measured_expert_terms(self, convention: Convention) -> Iterator[tuple[str, str, sympy.Expr]]:
        """Under ``moe="actual"``: each expert module's matmul FLOPs per phase as its measured forward
        FLOPs (column ``routed_i``) times the traced ratio of that phase to the traced forward,
        a number for a module whose products are linear in the rows it is given (an FFN)."""
        model = convention.but(moe="model")
        measured_as = FLOPCOUNTER.but(moe="model", count="matmul")
        for i, path in enumerate(self.experts):
            forward = self._matmul_formula(path, "fwd", measured_as)
            for phase in PHASES:
                traced = self._matmul_formula(path, phase, model)
                if traced == 0:
                    continue
                ratio = sympy.simplify(traced / forward) if forward != 0 else None
                if ratio is None or not ratio.is_number:
                    raise ValueError(
                        f"moe='actual': the {phase} FLOPs of expert module {path!r} are not proportional to its "
                        f"forward ({traced} vs {forward}), so they cannot be scaled from measured forward FLOPs"
                    )
                yield path, phase, ratio * self.routed[i]

    def _matmul_formula(self, path: str, phase: str, convention: Convention) -> sympy.Expr:
        """Inclusive matmul-kind FLOPs of module ``path`` in ``phase`` under ``convention``."""
        inside = [t for t in self.terms if t.kind == "matmul" and (t.module == path or t.module.startswith(path + "."))]
        return sympy.expand(sum((f for _, ph, f in _counted(inside, convention) if ph == phase), sympy.Integer(0)))

    def _formulas(self, convention: Convention) -> dict[tuple[str, str], sympy.Expr]:
        """Inclusive formula per (module, phase) under ``convention`` (cached)."""
        if convention not in self._formula_cache:
            formulas: dict[tuple[str, str], sympy.Expr] = defaultdict(lambda: sympy.Integer(0))
            for module, phase, flops in self._convention_terms(convention):
                for path in _ancestors(module):
                    formulas[(path, phase)] += flops
            self._formula_cache[convention] = {key: sympy.expand(expr) for key, expr in formulas.items()}
        return self._formula_cache[convention]

    def _rows(self, convention: Convention) -> tuple[dict[tuple[str, str], list[tuple[int, int]]], int]:
        """Integer coefficient rows over ``self.basis`` per (module, phase), and their common
        denominator, under ``convention`` (cached)."""
        if convention not in self._row_cache:
            coefficient_maps = {key: expr.as_coefficients_dict() for key, expr in self._formulas(convention).items()}
            column = {m: i for i, m in enumerate(self.basis)}
            denominator = math.lcm(1, *(sympy.fraction(c)[1] for cm in coefficient_maps.values() for c in cm.values()))
            rows = {
                key: [(column[m], int(c * denominator)) for m, c in cm.items()] for key, cm in coefficient_maps.items()
            }
            self._row_cache[convention] = (rows, denominator)
        return self._row_cache[convention]

    def _compile(self) -> None:
        """The monomial basis of every convention's polynomials and the generated evaluators."""
        self._formula_cache: dict[Convention, dict[tuple[str, str], sympy.Expr]] = {}
        self._row_cache: dict[Convention, tuple[dict, int]] = {}
        variants = [t.flops for t in self.terms] + [t.causal_exact for t in self.terms if t.causal_exact is not None]
        monomials = {m for v in variants for m in sympy.expand(v).as_coefficients_dict()}
        # every symbol is a monomial too, so a Meter also sums sizes (tokens, images) per call
        regular = tuple(sorted(monomials | set(self.all_symbols), key=sympy.default_sort_key))
        # measured columns, filled in by routing probes (``fxflops/routing.py``) after a call ran: the
        # forward FLOPs of each expert module's products, calls, and calls whose routing was measured
        self.routed = tuple(sympy.Symbol(f"routed_{i}") for i in range(len(self.experts)))
        bookkeeping = (_CALLS, _MEASURED) if self.experts else ()
        self.basis: tuple[sympy.Expr, ...] = regular + self.routed + bookkeeping
        self._generate()

    def _generate(self) -> None:
        """``monomials(*values)`` and ``within_guards(*values)``: generated Python over the binder's
        symbol order (rebuilt after a copy or a load: generated code is not pickled)."""
        names = {sym: f"v{i}" for i, sym in enumerate(self.all_symbols)}
        params = ", ".join(names.values())
        regular = self.basis[: len(self.basis) - len(self.routed) - (2 if self.experts else 0)]
        tail = ["0"] * len(self.routed) + (["1", "0"] if self.experts else [])
        # a call whose device metadata is malformed adds nothing but its malformed flags (Meter.report)
        flags = set(self.binder.flags.values()) | {VALID}
        valid = f" * {names[VALID]}" if VALID in names else ""
        monomials = ", ".join([python_source(m, names) + ("" if m in flags else valid) for m in regular] + tail)
        exact = [_exactly(g.expr, self.all_symbols) for g in self.guards]
        checks = " and ".join(
            f"({python_source(g.expr, names)})" if evaluator is None else f"_exact[{i}]({params})"
            for i, (g, evaluator) in enumerate(zip(self.guards, exact))
        ) or "True"
        scope = generated(
            f"def monomials({params}):\n    return ({monomials}{',' if self.basis else ''})\n"
            f"def within_guards({params}):\n    return {checks}\n",
            "program",
            _exact=exact,
        )
        self.monomials: Callable[..., tuple[int, ...]] = scope["monomials"]
        self.within_guards: Callable[..., bool] = scope["within_guards"]

    def source(self) -> str:
        """The generated ``monomials`` and ``within_guards`` as Python source (the binder's reader:
        ``program.binder.source(args, kwargs)``)."""
        return self.monomials.source

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for generated_code in ("monomials", "within_guards"):
            state.pop(generated_code, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._generate()

    def with_routing(self, monomials: tuple, measured: dict[str, Any]) -> tuple:
        """One call's monomials with the forward FLOPs its expert modules measured (``fxflops/routing.py``)
        in the ``routed_i`` columns; the call counts as measured when every expert module was."""
        if not self.experts:
            return monomials
        head = list(monomials[: len(monomials) - len(self.routed) - 2])
        complete = all(path in measured for path in self.experts)
        return (*head, *(measured.get(path, 0) for path in self.experts), 1, int(complete))

    # ---- evaluation ---------------------------------------------------------------------------
    def required_symbols(self, convention: Convention | None = None) -> tuple[sympy.Symbol, ...]:
        """The symbols the polynomials of ``convention`` (default: the program's) and the guards use."""
        used = set().union(
            *(f.free_symbols for f in self._formulas(convention or self.convention).values()),
            *(g.expr.free_symbols for g in self.guards),
        )
        return tuple(s for s in self.all_symbols if s in used)

    def values_of(self, convention: Convention | None = None, **values: int) -> tuple[int, ...]:
        """Values in the binder's symbol order (symbols the convention's polynomials and the guards do
        not use may be left out); raise on a missing one, an unknown name, or values outside the guards."""
        required = self.required_symbols(convention)
        missing = [str(s) for s in required if str(s) not in values]
        unknown = sorted(set(values) - {str(s) for s in self.all_symbols})
        if missing or unknown:
            problem = f"no value for symbol(s) {missing}" if missing else f"unknown symbol(s) {unknown}"
            raise UnboundSymbolError(f"{problem}; the program's symbols are {[str(s) for s in required]}")
        ordered = tuple(int(values.get(str(s), 1 if s is VALID else 0)) for s in self.all_symbols)
        if not self.within_guards(*ordered):
            raise GuardError(self.explain_guard_failure(ordered))
        return ordered

    def explain_guard_failure(self, ordered: tuple[int, ...]) -> str:
        """Which guard these values break, with the model line that made it."""
        subs = {s: v for s, v in zip(self.all_symbols, ordered) if isinstance(v, int) and s in self.symbols}
        broken = [g for g in self.guards if not bool(g.expr.xreplace(subs))]
        shown = ", ".join(f"{s}={v}" for s, v in subs.items())
        return f"{shown} break the trace's guard(s): " + "; ".join(map(str, broken))

    def evaluate(
        self,
        monomial_sums: tuple[int, ...] | list[int],
        module: str = "",
        phase: str | tuple[str, ...] | None = None,
        convention: Convention | None = None,
    ) -> int:
        """``C[module, phase] · m`` for accumulated monomials ``m`` (all phases when ``phase`` is None;
        a tuple sums several) under ``convention`` (default: the program's)."""
        convention = convention or self.convention
        if convention.moe == "actual" and self.experts:
            calls, measured = monomial_sums[-2], monomial_sums[-1]
            if measured != calls:
                raise ValueError(
                    f"moe='actual' needs the routing of every call measured, but {calls - measured} of {calls} "
                    f"call(s) of this program were not (expert modules {list(self.experts)}): count with "
                    "fxflops.instrument(model, measure_routing=True), or use moe='model'"
                )
        rows, denominator = self._rows(convention)
        phases = PHASES if phase is None else (phase,) if isinstance(phase, str) else phase
        total = 0
        for ph in phases:
            for col, coeff in rows.get((module, ph), ()):
                total += coeff * _exact_int(monomial_sums[col])  # Python ints: no int64 overflow
        return total // denominator

    def malformed(self, monomial_sums: tuple | list) -> dict[str, int]:
        """``{metadata input: calls whose metadata on a device was malformed}`` in accumulated
        monomials (those calls added nothing else)."""
        column = {m: i for i, m in enumerate(self.basis)}
        found = {str(flag)[len("malformed_"):]: _exact_int(monomial_sums[column[flag]]) for flag in self.binder.flags.values()}
        return {name: n for name, n in found.items() if n}

    def total(self, phase: str | None = None, convention: Convention | None = None, **values: int) -> int:
        """Total FLOPs at these symbol values, e.g. ``program.total(seq=2048)``."""
        return self.evaluate(self.monomials(*self.values_of(convention, **values)), "", phase, convention)

    def breakdown(
        self, depth: int | None = None, phase: str | None = None, convention: Convention | None = None, **values: int
    ) -> dict[str, int]:
        """Inclusive FLOPs of every module (``depth``: only paths at most that deep; root depth 0)."""
        m = self.monomials(*self.values_of(convention, **values))
        return {path: self.evaluate(m, path, phase, convention) for path in self.modules(depth)}

    def modules(self, depth: int | None = None) -> list[str]:
        """Module paths in tree order (pre-order from the root), optionally cut at ``depth``."""
        order = list(nx.dfs_preorder_nodes(self.tree, ""))
        return [p for p in order if depth is None or _depth(p) <= depth]

    def formula(self, path: str = "", phase: str | None = None, convention: Convention | None = None) -> sympy.Expr:
        """Closed form of a module's inclusive FLOPs in the named symbols under ``convention``."""
        formulas = self._formulas(convention or self.convention)
        phases = PHASES if phase is None else (phase,)
        return sympy.expand(sum((formulas.get((path, ph), 0) for ph in phases), sympy.Integer(0)))

    def values(self, *args: Any, **kwargs: Any) -> tuple[int, ...]:
        """The symbol values of the call ``model(*args, **kwargs)``, in ``all_symbols`` order (the
        model family's adapter first adds the metadata the model would derive, see ``prepare``).
        Raises :class:`GuardError` when the call or the model is not in the situation the program
        was traced in (another input present or ``None``, another Python argument, a module's
        ``training`` flag flipped, ...; ``fxflops/situation.py``)."""
        args, kwargs = self.prepare(args, kwargs)
        self.check_situation(args, kwargs)
        return self.binder.values(args, kwargs)

    def check_situation(self, args: tuple, kwargs: dict) -> None:
        """Raise when ``model(*args, **kwargs)`` (already prepared) is not a call of the traced
        situation: :class:`InputError` naming the input when the call differs (another input present
        or ``None``, another dtype, rank or Python argument), :class:`GuardError` when the model's
        state does. Grad and autocast modes are not part of this check: it counts the call as traced."""
        if self.situation is not None and (key := self.call_keys(args, kwargs)) != self.situation[0]:
            try:
                self.binder.values(args, kwargs)  # its message names the dim when a shape is off
            except InputError:
                raise
            except Exception:  # noqa: BLE001 - described below instead
                pass
            raise InputError(f"this call is not the traced one: {describe_difference(self.situation, (key, self.situation[1]))}")
        if self.state is not None and not self.state.matches():
            raise GuardError(f"the model is not in the state it was traced in: {self.state.mismatch()}")

    def count(self, *args: Any, **kwargs: Any) -> int:
        """FLOPs of ``model(*args, **kwargs)`` from the batch's shapes, without running the model
        (metadata on a device is read: an explicit count may sync)."""
        values = self.values(*args, **kwargs)
        if not self.within_guards(*values):
            raise GuardError(self.explain_guard_failure(values))
        monomials = self.monomials(*values)
        malformed = self.malformed(monomials)
        if malformed:
            raise MetadataError(f"malformed segment metadata {sorted(malformed)} (offsets not from 0, decreasing, or past the packed length)")
        return self.evaluate(monomials)

    @property
    def power_sums(self) -> dict[str, tuple[str, int]]:
        """Each segment power-sum symbol's name -> (its family's name, k): the symbol is pₖ = Σᵢ sᵢᵏ
        of that family's segment lengths (the binder computes it from the offsets or grid)."""
        return {str(sym): (family.name, k) for sym, (family, k) in self.binder.stats.items()}

    def describe_symbols(self) -> dict[str, str]:
        """What each symbol means: an input dimension or a segment power sum."""
        meaning = {}
        for path, exprs in self.binder.dim_exprs.items():
            for d, expr in enumerate(exprs):
                if isinstance(expr, sympy.Symbol) and str(expr) not in meaning:
                    meaning[str(expr)] = f"dim {d} of input {path_label(path)}"
        families = {family.name: family for family in self.families}
        for name, (family, k) in self.power_sums.items():
            meaning[name] = f"Σᵢ sᵢ^{k} over {families[family].describe()}"
        return {str(s): meaning.get(str(s), "") for s in self.symbols}

    # ---- reporting -----------------------------------------------------------------------------
    def to_json(self) -> str:
        """Symbols, guards, per-module formulas, terms and unsupported ops as a JSON document."""
        return json.dumps(
            {
                "symbols": [str(s) for s in self.symbols],
                "guards": [{"expr": str(g.expr), "location": g.location} for g in self.guards],
                "convention": self.convention.describe(),
                "modules": {
                    path: {ph: str(f) for ph in PHASES if (f := self.formula(path, ph)) != 0}
                    for path in self.modules()
                },
                "terms": [
                    {"node": t.node, "op": t.op, "module": t.module, "phase": t.phase, "flops": str(t.flops)}
                    for t in self.terms
                ],
                "unsupported": [
                    {"node": u.node, "op": u.op, "module": u.module}
                    for u in self.unsupported
                ],
                "notes": self.notes,
            },
            indent=2,
        )

    def plot(self, kind: str = "breakdown", **options: Any) -> Any:
        """A matplotlib figure: ``"breakdown"`` (per-module bars by depth) or ``"scaling"`` (FLOPs
        against one size); the same implementation the CLI's ``--plot`` uses (``fxflops/plot.py``)."""
        from fxflops.plot import plot

        return plot(self, kind, **options)

    def table(self, depth: int | None = None, convention: Convention | None = None, **values: int) -> str:
        """A readable per-module table; with symbol values also the FLOPs and each module's share."""
        from fxflops.report import program_table

        return program_table(self, depth, values, convention or self.convention)

    def __repr__(self) -> str:
        return (
            f"Program(symbols={[str(s) for s in self.symbols]}, terms={len(self.terms)}, "
            f"modules={self.tree.number_of_nodes()}, guards={len(self.guards)}, "
            f"unsupported={len(self.unsupported)})"
        )
