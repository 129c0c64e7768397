"""Mixture-of-experts structure in a traced graph: router GEMMs, expert modules, routed token groups."""

from __future__ import annotations

import operator
from dataclasses import replace

import sympy
import torch

from fxflops.analysis.paths import depth, module_path
from fxflops.analysis.terms import Term
from fxflops.capture.graph import op_name
from fxflops.capture.phases import phase_of
from fxflops.errors import CaptureError
from fxflops.rules import entry_for

_ROUTER_CHOICES = frozenset({"topk", "sort", "argsort"})


def _is_product(node: torch.fx.Node) -> bool:
    entry = entry_for(node.target) if node.op == "call_function" else None
    return entry is not None and entry.kind == "matmul"


def _products_feeding(choice: torch.fx.Node) -> set[torch.fx.Node]:
    """The matrix products whose result reaches ``choice`` through no other matrix product."""
    found: set[torch.fx.Node] = set()
    stack, seen = list(choice.all_input_nodes), set()
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if _is_product(node):
            found.add(node)
        else:
            stack.extend(node.all_input_nodes)
    return found


def router_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Mixture-of-experts router GEMMs: the matrix products whose result reaches a top-k (or sort)
    expert choice through no other matrix product (logits -> softmax/sigmoid/bias -> topk), with
    their backward nodes (the same autograd sequence number). Conventions that leave the router
    out (Megatron: "router GEMM not counted", FORMULAS.md §1) skip them."""
    found: set[torch.fx.Node] = set()
    for choice in graph.nodes:
        if choice.op == "call_function" and op_name(choice.target) in _ROUTER_CHOICES:
            found |= _products_feeding(choice)
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
                found.setdefault(max(readers, key=depth), indices)
    return dict(sorted(found.items()))


def routed_rows_as_pairs(terms: list[Term], routed: dict[str, set[sympy.Symbol]], pairs: dict[str, sympy.Expr]) -> list[Term]:
    """The ``model`` count of an expert module whose dispatch loops over the experts with
    data-dependent token groups (``rows = (expert == e).nonzero()``): each group's size is a
    data-dependent symbol uₑ, and a dropless dispatch gives Σₑ uₑ = the number of (token, expert)
    pairs. With experts of equal cost (every uₑ with the same coefficients), Σₑ c·uₑ = c·pairs,
    so each uₑ becomes pairs / E. Uneven experts have no ``model`` count: refused (measure them)."""
    for path, symbols in routed.items():
        signatures = {
            u: sorted((t.op, t.phase, str(sympy.expand(t.flops).coeff(u))) for t in terms if u in t.flops.free_symbols)
            for u in symbols
        }
        if len({tuple(v) for v in signatures.values()}) > 1:
            raise CaptureError(
                f"expert module {path!r} gives its experts different costs per token, so top_k x tokens x "
                "expert cost (moe='model') is not defined; fxflops cannot count it from shapes"
            )
        share = {u: pairs[path] / len(symbols) for u in symbols}
        terms = [_substituted(t, share) if t.flops.free_symbols & symbols else t for t in terms]
    return terms


def _substituted(term: Term, values: dict) -> Term:
    def substituted(flops: sympy.Expr | None) -> sympy.Expr | None:
        return None if flops is None else sympy.expand(flops.xreplace(values))

    return replace(term, flops=substituted(term.flops), causal_exact=substituted(term.causal_exact), causal_half=substituted(term.causal_half))
