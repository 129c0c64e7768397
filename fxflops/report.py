"""Plain-text tables and JSON of programs and meters (read through their public methods)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fxflops.analysis.counted import PHASES
from fxflops.analysis.paths import depth as path_depth

if TYPE_CHECKING:
    from fxflops.conventions import Convention
    from fxflops.program import Program


def human(flops: int) -> str:
    """``1234567`` -> ``1.23 MFLOP``: engineering units, exact value kept elsewhere."""
    for unit, scale in (("PFLOP", 10**15), ("TFLOP", 10**12), ("GFLOP", 10**9), ("MFLOP", 10**6), ("KFLOP", 10**3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops} FLOP"


def render(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned numbers, one space-padded line per row."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, ["-" * w for w in widths], *rows]:
        cells = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(row)]
        if len(row) > 3 and row is not header:  # formula column reads better left-aligned
            cells[-1] = str(row[-1]).ljust(widths[-1])
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _label(path: str) -> str:
    depth = path_depth(path)
    return "  " * depth + (path.rsplit(".", 1)[-1] if path else "<model>")


def program_table(program: Program, depth: int | None, values: dict[str, Any], convention: Convention) -> str:
    """Module | FLOPs | share | formula; FLOPs and share only when every symbol has a value."""
    modules = [p for p in program.modules(depth) if program.formula(p, convention=convention) != 0]
    if values:
        flops = program.breakdown(depth, convention=convention, **values)
        total = flops[""] or 1
        rows = [
            [_label(p), f"{flops[p]:,}", f"{100 * flops[p] / total:.1f}%", str(program.formula(p, convention=convention))]
            for p in modules
        ]
        header = ["module", "FLOPs", "share", "formula"]
        title = "FLOPs at " + ", ".join(f"{k}={v}" for k, v in values.items())
    else:
        rows = [[_label(p), str(program.formula(p, convention=convention))] for p in modules]
        header = ["module", "formula"]
        title = "FLOPs formulas in " + ", ".join(str(s) for s in program.symbols)
    notes = "".join(f"\nnote: {n}" for n in program.notes)
    unsupported = "".join(f"\nNOT COUNTED (no rule): {u}" for u in program.unsupported)
    captured = "captured: forward only (no backward terms)" if program.backward == "none" else "captured: forward + backward"
    return f"{title}\nconvention {convention.describe()}; {captured}\n" + render(header, rows) + notes + unsupported


def meter_table(breakdown: dict[str, int]) -> str:
    """Module | accumulated FLOPs | share, from a Meter's breakdown."""
    total = breakdown.get("", 0) or 1
    rows = [[_label(p), f"{v:,}", human(v), f"{100 * v / total:.1f}%"] for p, v in breakdown.items() if v]
    return render(["module", "FLOPs", "", "share"], rows)


def program_json(program: Program) -> str:
    """Symbols, guards, per-module formulas, terms and unsupported ops as a JSON document."""
    return json.dumps(
        {
            "symbols": [str(s) for s in program.symbols],
            "guards": [{"expr": str(g.expr), "location": g.location} for g in program.guards],
            "convention": program.convention.describe(),
            "modules": {
                path: {ph: str(f) for ph in PHASES if (f := program.formula(path, ph)) != 0}
                for path in program.modules()
            },
            "terms": [
                {"node": t.node, "op": t.op, "module": t.module, "phase": t.phase, "flops": str(t.flops)}
                for t in program.terms
            ],
            "unsupported": [{"node": u.node, "op": u.op, "module": u.module} for u in program.unsupported],
            "notes": program.notes,
        },
        indent=2,
    )
