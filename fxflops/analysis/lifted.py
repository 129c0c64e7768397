"""Billing the work a capture left as markers (``capture/markers.py``): per-segment modules as power
sums of their segment lengths, repeated layers as copies of their template's terms."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import sympy
import torch

from fxflops.analysis.paths import inside, moved
from fxflops.analysis.segments import SegmentLengths
from fxflops.analysis.terms import Term
from fxflops.capture.lifting import SEGMENT
from fxflops.capture.markers import repeated_layer
from fxflops.capture.phases import phase_of
from fxflops.errors import CaptureError


def summed_over_segments(flops: sympy.Expr, lengths: SegmentLengths, op: str, module: str) -> sympy.Expr:
    """One segment's FLOPs P(s) = Σₖ cₖ·sᵏ summed over a batch's segments: Σₖ cₖ·pₖ, pₖ = Σᵢ sᵢᵏ."""
    if not flops.free_symbols <= {SEGMENT} or not flops.is_polynomial(SEGMENT):
        raise CaptureError(
            f"the FLOPs of {op} in per-segment module {module!r} are not a polynomial in the segment length: {flops}"
        )
    coefficients = sympy.Poly(flops, SEGMENT).all_coeffs()[::-1]
    return sympy.expand(sum((c * lengths.power_sum(k) for k, c in enumerate(coefficients) if c != 0), sympy.Integer(0)))


def per_segment_terms(
    marker: str, inner: list[Term], lengths: SegmentLengths, phase: str, backward_ran: bool
) -> list[Term]:
    """A lifted module's one-segment terms billed over the segments of its call (graph node
    ``marker``): the forward in ``phase`` (where its markers are: ``fwd``, or ``recompute`` under
    activation checkpointing), the backward (and the recompute inside it) only if this call's
    backward ran."""

    def billed(flops: sympy.Expr | None, term: Term) -> sympy.Expr | None:
        return None if flops is None else summed_over_segments(flops, lengths, term.op, term.module)

    return [
        replace(
            t, node=f"{marker}.{t.node}", phase=phase if t.phase == "fwd" else t.phase,
            flops=billed(t.flops, t), causal_exact=billed(t.causal_exact, t), causal_half=billed(t.causal_half, t),
        )
        for t in inner
        if t.phase == "fwd" or backward_ran
    ]


def _layer_phases(graph: torch.fx.Graph) -> dict[str, set[str]]:
    """The passes autograd ran each reused layer in: the forward where its markers are, the backward
    and its recompute where its marker's backward is."""
    phases: dict[str, set[str]] = defaultdict(set)
    for node in graph.nodes:
        found = repeated_layer(node)
        if found is None:
            continue
        layer, is_backward = found
        if is_backward:  # a recompute runs in the backward pass
            phases[layer].update(("bwd", "recompute"))
        elif phase_of(node) == "fwd":
            phases[layer].add("fwd")
    return phases


def repeated_terms(terms: list[Term], graph: torch.fx.Graph, reused: dict[str, str]) -> list[Term]:
    """Each reused layer (``capture/reuse.py``) billed its template's terms under its own path, in
    the passes autograd really ran it: the forward where its markers are, the backward and its
    recompute (checkpointing, a fused attention backward's Q·Kᵀ) only where its marker's backward
    ran. Inner layers first, so a template's own reused layers count."""
    phases = _layer_phases(graph)
    for layer, template in sorted(reused.items(), key=lambda item: -item[0].count(".")):
        terms = terms + [
            replace(t, node=f"{t.node}@{layer}", module=moved(t.module, template, layer))
            for t in terms
            if inside(t.module, template) and t.phase in phases[layer]
        ]
    return terms
