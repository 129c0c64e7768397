"""The analysis stage: a capture's graph -> the FLOPs of every node, as exact sympy terms.

:func:`analyze` runs the per-node pass (``nodes.py``, in the style of ``torch.fx.Interpreter``) over
the captured graph with the segment families it finds (``segments.py``), bills the work the capture
left as markers (``lifted.py``), finds mixture-of-experts structure (``moe.py``) and returns one
typed :class:`Analysis`. ``counted.py`` says how a convention counts the terms; ``paths.py`` holds the
module-path helpers every stage uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from fxflops.analysis.lifted import repeated_terms
from fxflops.analysis.masks import KeptPairs
from fxflops.analysis.moe import expert_modules
from fxflops.analysis.nodes import NodeRules
from fxflops.analysis.paths import inside, moved
from fxflops.analysis.segments import Family, SegmentAnalysis
from fxflops.analysis.terms import Term, Unsupported
from fxflops.capture.inputs import path_label
from fxflops.capture.trace import Captured
from fxflops.errors import CaptureError, warn


@dataclass(frozen=True)
class Analysis:
    """What the rules found in one capture.

    ``terms`` and ``unsupported`` per graph node (reused layers' copies included); ``notes`` on how
    some ops were counted; ``families`` the segment families the terms use and ``power_sums`` their
    symbols, ``{pₖ symbol: (family, k)}``; ``flags`` a malformed-metadata symbol per family name;
    ``experts`` the mixture-of-experts expert modules; ``reused`` layer -> the traced layer it repeats;
    ``kept_pairs`` the symbols of attention masks' kept (batch, query, key) triples that depend on a
    padding input (``masks.py``), which the binder computes per call.
    """

    terms: list[Term]
    unsupported: list[Unsupported]
    notes: list[str]
    families: list[Family]
    power_sums: dict[sympy.Symbol, tuple[Family, int]]
    flags: dict[str, sympy.Symbol]
    experts: tuple[str, ...]
    reused: dict[str, str]
    kept_pairs: dict[sympy.Symbol, KeptPairs]


def _warn_unsupported(unsupported: list[Unsupported]) -> None:
    for op in sorted({u.op for u in unsupported}):
        where = sorted({u.module or "<root>" for u in unsupported if u.op == op})
        warn(
            f"fxflops: no FLOPs rule for {op} (in {', '.join(where)}); its work is not counted "
            "and program.unsupported lists it. Register one with fxflops.rules.register.",
            stacklevel=4,
        )


def _experts(captured: Captured) -> tuple[str, ...]:
    """Expert modules of the traced graph, and their copies inside reused layers."""
    traced = list(expert_modules(captured.graph_module.graph))
    copies = [moved(e, t, layer) for layer, t in captured.reused.items() for e in traced if inside(e, t)]
    return tuple(sorted({*traced, *copies}))


def analyze(captured: Captured, segment_names: dict[str, str] | None = None) -> Analysis:
    """The FLOPs of every node of ``captured``. ``segment_names`` names segment families by the
    input they come from (``{"cu_seqlens": "text"}``)."""
    graph = captured.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    paths = dict(zip(placeholders, captured.placeholder_paths))
    segments = SegmentAnalysis(graph, paths, segment_names or {})
    found = NodeRules(graph, captured.named, set(captured.symbols.values()), segments, captured.lifted, placeholders=paths).run()
    if captured.assumptions() != captured.assumptions_at_capture:
        raise CaptureError("internal error: the FLOPs analysis added a guard on the traced sizes; please report")
    _warn_unsupported(found.unsupported)
    by_name = {f.name: f for f in segments.families.values()}
    power_sums = {by_name[name].power_sum(k): (by_name[name], k) for name, k in segments.requested}
    used = sorted({name for name, _ in segments.requested})
    return Analysis(
        terms=repeated_terms(found.terms, graph, captured.reused),
        unsupported=found.unsupported,
        notes=list(dict.fromkeys(found.notes)),
        families=[by_name[name] for name in used],
        power_sums=power_sums,
        flags={name: sympy.Symbol(f"malformed_{path_label(by_name[name].source)}") for name in used},
        experts=_experts(captured),
        reused=dict(captured.reused),
        kept_pairs=found.kept_pairs,
    )


__all__ = ["Analysis", "Term", "Unsupported", "analyze"]
