"""Terms as a convention counts them (``fxflops/conventions.py``): which terms, and how much of each."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import sympy

from fxflops.analysis.paths import inside
from fxflops.analysis.terms import Term
from fxflops.conventions import FLOPCOUNTER, Convention

PHASES = ("fwd", "bwd", "recompute")


def checked_phase(phase: str | None, phases: tuple[str, ...] = PHASES) -> str | None:
    """``phase`` when it is one of ``phases`` or None (every phase); ValueError otherwise (a typo
    would read as a phase with no FLOPs)."""
    if phase is not None and phase not in phases:
        raise ValueError(f"phase must be one of {phases} or None, not {phase!r}")
    return phase


def _left_out(term: Term, convention: Convention) -> bool:
    return (
        (term.kind == "elementwise" and convention.count != "all")
        or (term.kind == "embedding" and not convention.embeddings)
        or (term.router and not convention.router)
        or (term.phase == "recompute" and not convention.recompute)
        or (term.phase == "bwd" and convention.backward == "2x")
    )


def counted(terms: Iterable[Term], convention: Convention) -> Iterator[tuple[str, str, sympy.Expr]]:
    """(module, phase, FLOPs) of ``terms`` as ``convention`` counts them, term by term."""
    for term in terms:
        if _left_out(term, convention):
            continue
        flops = term.flops
        if term.causal_exact is not None and convention.causal == "exact":
            flops = term.causal_exact
        elif term.causal_exact is not None and convention.causal == "half":
            flops = term.flops / 2 if term.causal_half is None else term.causal_half
        if convention.unit == "macs":
            flops = flops / 2
        yield term.module, term.phase, flops
        if term.phase == "fwd" and convention.backward == "2x":
            yield term.module, "bwd", 2 * flops


def _matmul_formula(terms: list[Term], path: str, phase: str, convention: Convention) -> sympy.Expr:
    """Inclusive matmul-kind FLOPs of module ``path`` in ``phase`` under ``convention``."""
    inner = [t for t in terms if t.kind == "matmul" and inside(t.module, path)]
    return sympy.expand(sum((f for _, ph, f in counted(inner, convention) if ph == phase), sympy.Integer(0)))


def measured_expert_terms(
    terms: list[Term], experts: tuple[str, ...], routed: tuple[sympy.Symbol, ...], convention: Convention
) -> Iterator[tuple[str, str, sympy.Expr]]:
    """Under ``moe="actual"``: each expert module's matmul FLOPs per phase as its measured forward
    FLOPs (column ``routed[i]``) times the traced ratio of that phase to the traced forward, a
    number for a module whose products are linear in the rows it is given (an FFN)."""
    model = convention.but(moe="model")
    measured_as = FLOPCOUNTER.but(moe="model", count="matmul")
    for path, column in zip(experts, routed):
        forward = _matmul_formula(terms, path, "fwd", measured_as)
        for phase in PHASES:
            traced = _matmul_formula(terms, path, phase, model)
            if traced == 0:
                continue
            ratio = sympy.simplify(traced / forward) if forward != 0 else None
            if ratio is None or not ratio.is_number:
                raise ValueError(
                    f"moe='actual': the {phase} FLOPs of expert module {path!r} are not proportional to its "
                    f"forward ({traced} vs {forward}), so they cannot be scaled from measured forward FLOPs"
                )
            yield path, phase, ratio * column


def convention_terms(
    terms: list[Term], experts: tuple[str, ...], routed: tuple[sympy.Symbol, ...], convention: Convention
) -> Iterator[tuple[str, str, sympy.Expr]]:
    """(module, phase, FLOPs) of every term as ``convention`` counts it; under ``moe="actual"`` the
    products of expert modules are their measured columns instead."""
    if convention.moe != "actual" or not experts:
        yield from counted(terms, convention)
        return
    yield from counted([t for t in terms if not (t.kind == "matmul" and any(inside(t.module, e) for e in experts))], convention)
    yield from measured_expert_terms(terms, experts, routed, convention)
