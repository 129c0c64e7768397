"""Plots of a :class:`~fxflops.program.Program`: where the FLOPs go, and how they scale.

matplotlib is optional: it is imported inside the plotting functions (``pip install matplotlib``).
Figures are made with the Agg backend directly (``matplotlib.figure.Figure`` + ``FigureCanvasAgg``):
pyplot's global state and figure registry are never touched, so plotting works headless, leaks no
figures and never switches the backend of an interactive session. Every function returns the
``Figure`` and writes a PNG when given ``path``; pass ``ax`` to draw into an existing Axes instead.

* :func:`plot_breakdown` — inclusive FLOPs per module at given sizes, one horizontal stacked bar per
  module depth (1..``depth``).
* :func:`plot_scaling` — the total FLOPs polynomial as a function of one size symbol, split into the
  part that grows faster than linearly in that size (attention-like) and the rest, with the exact
  size at which the first overtakes the second. :func:`scaling_split` computes the same split and
  crossover without matplotlib.
* :func:`plot` — ``kind="breakdown" | "scaling"`` dispatch; ``Program.plot`` delegates to it.

The maths of the scaling split (how power sums move with the varied size, the exact crossover)
is in ``docs/scaling.md``; it is computed in ``fxflops/scaling.py``, without matplotlib.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy

from fxflops.analysis.paths import depth as path_depth
from fxflops.report import human
from fxflops.scaling import SEGMENT_RULES, ScalingSplit, sample_sizes, scaling_split

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from fxflops.conventions import Convention
    from fxflops.program import Program

KINDS = ("breakdown", "scaling")
DPI = 100


# ---- matplotlib ---------------------------------------------------------------------------------
def _figure(ax: Axes | None, figsize: tuple[float, float], dpi: float) -> tuple[Figure, Axes, bool]:
    """(figure, axes, owned): a new Agg figure with one Axes, or ``ax`` and its figure."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "fxflops plotting needs matplotlib, which is not installed: pip install matplotlib"
        ) from exc
    if ax is not None:
        return ax.figure, ax, False
    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(), True


def _save(fig: Figure, path: Any) -> None:
    if path is not None:
        fig.savefig(path, format="png", dpi=fig.dpi)


def _convention_lines(convention: Convention, width: int = 120) -> str:
    return "\n".join(textwrap.wrap(f"convention {convention.describe()}", width))


def _values_text(values: dict[str, Any], skip: Iterable[str] = ()) -> str:
    skip = set(skip)
    return ", ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}" for k, v in values.items() if k not in skip)


def _short(expr: sympy.Expr, limit: int = 70) -> str:
    text = sympy.sstr(expr)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---- breakdown ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """One piece of a breakdown bar: ``path`` (a module path; ``own`` marks the FLOPs of ``path``'s
    own ops outside its child modules) and its inclusive FLOPs."""

    path: str
    flops: int
    own: bool = False

    @property
    def label(self) -> str:
        name = self.path or "<model>"
        return f"{name} (own ops)" if self.own else name


def _short_name(path: str) -> str:
    """The last component of a module path, with its parent's when it is an index (``layers.0``)."""
    parts = path.split(".") if path else ["<model>"]
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def breakdown_levels(
    program: Program,
    values: dict[str, int],
    depth: int = 2,
    phase: str | None = None,
    convention: Convention | None = None,
) -> list[list[Segment]]:
    """The bars of :func:`plot_breakdown`: for each depth 1..``depth`` a list of segments that sum to
    the total. Level d splits every module of level d−1 into its children (inclusive FLOPs) plus, if
    nonzero, the module's own ops outside them; a module with no children (``lm_head``) or an own-ops
    piece is carried down unchanged. Zero-FLOP modules are left out."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, not {depth}")
    flops = program.breakdown(depth, phase, convention, **values)
    children: dict[str, list[str]] = {}
    for path in program.modules(depth):
        if path:
            children.setdefault(_parent(path), []).append(path)
    level = [Segment("", flops[""])]
    levels = []
    for _ in range(depth):
        nxt = []
        for seg in level:
            kids = [] if seg.own else [k for k in children.get(seg.path, ()) if flops[k]]
            if not kids:
                nxt.append(seg)
                continue
            nxt += [Segment(k, flops[k]) for k in kids]
            rest = seg.flops - sum(flops[k] for k in kids)
            if rest:
                nxt.append(Segment(seg.path, rest, own=True))
        levels.append(nxt)
        level = nxt
    return levels


def _colours(levels: list[list[Segment]]) -> dict[Segment, tuple[float, float, float]]:
    """A hue per depth-1 module; its descendants are lighter shades of it, siblings alternate."""
    from matplotlib import colormaps
    from matplotlib.colors import to_rgb

    palette = colormaps["tab10"].colors
    top = {seg.path: i for i, seg in enumerate(levels[0])}
    colours = {}
    for level in levels:
        siblings: dict[str, int] = {}
        for seg in level:
            if seg in colours:
                continue
            root = seg.path.split(".")[0] if seg.path else ""
            base = to_rgb(palette[top.get(root, len(top)) % len(palette)])
            if seg.path in top and not seg.own:
                colours[seg] = base
                continue
            parent = seg.path if seg.own else _parent(seg.path)
            index = siblings[parent] = siblings.get(parent, -1) + 1
            depth = path_depth(seg.path)
            mix = min(0.75, 0.18 * (depth - 1) + 0.12 * (index % 3) + (0.3 if seg.own else 0.0))
            colours[seg] = tuple(c + (1 - c) * mix for c in base)
    return colours


def plot_breakdown(
    program: Program,
    values: dict[str, int],
    *,
    depth: int = 2,
    phase: str | None = None,
    convention: Convention | None = None,
    ax: Axes | None = None,
    path: Any = None,
    figsize: tuple[float, float] | None = None,
    dpi: float = DPI,
) -> Figure:
    """Where the FLOPs go at ``values``: one horizontal stacked bar per module depth 1..``depth``.

    Each bar spans the total FLOPs (``program.total(phase, convention, **values)``) and is split into
    the modules of that depth, each at its inclusive FLOPs (its submodules included), as
    :func:`breakdown_levels` computes them: a module with no children at the next depth is carried
    down, and a module's own ops outside its children become a ``(own ops)`` piece, so every bar sums
    to the total. Pieces of at least 6% are labelled in the bar (name and share); the legend lists
    every piece with its full path, share and FLOPs. Colours follow the depth-1 module a piece belongs
    to. The title names the values, the total, the phase and the convention (``convention`` or the
    program's, with :meth:`Convention.describe`).

    ``figsize`` defaults to 11 inches wide and a height that fits the bars and the legend; ``dpi``
    100. Returns the Figure (``fig.fxflops_breakdown`` holds the levels); writes a PNG to ``path``.
    """
    convention = convention or program.convention
    levels = breakdown_levels(program, values, depth, phase, convention)
    total = sum(seg.flops for seg in levels[0])
    legend = list(dict.fromkeys(seg for level in levels for seg in level))
    rows = math.ceil(len(legend) / 2)
    figsize = figsize or (11.0, 2.2 + 0.55 * depth + 0.24 * rows)
    fig, ax, owned = _figure(ax, figsize, dpi)
    colours = _colours(levels)

    handles = {}
    for y, level in enumerate(levels):
        left = 0
        for seg in level:
            share = seg.flops / total if total else 0.0
            bar = ax.barh(y, seg.flops, left=left, color=colours[seg], edgecolor="white", linewidth=0.8, height=0.7)
            handles.setdefault(seg, bar[0])
            if share >= 0.06:
                name = "(own ops)" if seg.own else _short_name(seg.path)
                ax.text(left + seg.flops / 2, y, f"{name}\n{100 * share:.1f}%", ha="center", va="center", fontsize=7, clip_on=True)
            left += seg.flops
    ax.set_yticks(range(len(levels)), [f"depth {d + 1}" for d in range(len(levels))])
    ax.invert_yaxis()
    ax.set_xlim(0, total or 1)
    unit = "MACs" if convention.unit == "macs" else "FLOPs"
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(int(v)).replace("FLOP", unit[:-1])))
    ax.set_xlabel(f"inclusive {unit} per module (each bar sums to the total)")
    phase_text = f"phase {phase}" if phase else "all phases"
    used = {str(s) for s in program.required_symbols(convention)}
    shown = {k: v for k, v in values.items() if k in used}  # values the numbers depend on
    ax.set_title(
        f"{unit} per module at {_values_text(shown)}\ntotal {total:,} ({human(total)}), {phase_text}\n"
        + _convention_lines(convention),
        fontsize=9,
    )
    labels = [f"{seg.label}: {100 * seg.flops / (total or 1):.1f}% ({human(seg.flops)})" for seg in legend]
    if owned:
        fig.legend([handles[s] for s in legend], labels, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    else:
        ax.legend([handles[s] for s in legend], labels, loc="lower right", fontsize=6)
    fig.fxflops_breakdown = levels
    _save(fig, path)
    return fig


# ---- scaling --------------------------------------------------------------------------------------
def _segments_text(family: str, n: sympy.Expr, symbol: str, segments: str | int) -> str:
    if segments == "one":
        return f"{family}: one segment, pₖ = {symbol}ᵏ"
    count = sympy.sstr(n) if n.is_Integer else f"{float(n):.4g}"
    origin = " (from values: p₁²/p₂)" if segments == "equal" else ""
    return f"{family}: n = {count} equal segments{origin}, pₖ = {symbol}ᵏ/nᵏ⁻¹"


def _crossover_text(split: ScalingSplit) -> str:
    c = split.crossover
    if c is None:
        return ""
    if c.is_Integer:
        return f"crossover {split.symbol} = {c}"
    exact = sympy.sstr(c)
    approx = f"{float(c):,.6g}"
    return f"crossover {split.symbol} ≈ {approx}" + (f"\n(exact {exact})" if len(exact) <= 40 else "")


def plot_scaling(
    program: Program,
    symbol: str,
    values: dict[str, int],
    *,
    lo: int | None = None,
    hi: int | None = None,
    points: int = 200,
    segments: str | int = "equal",
    families: Iterable[str] | None = None,
    phase: str | None = None,
    convention: Convention | None = None,
    ax: Axes | None = None,
    path: Any = None,
    log: bool = True,
    figsize: tuple[float, float] = (10.0, 6.0),
    dpi: float = DPI,
) -> Figure:
    """Total FLOPs as a function of the size ``symbol``, drawn from the exact polynomial.

    Three curves over sizes ``lo``..``hi`` (``points`` integer sizes, geometric spacing and log-log
    axes when ``log``): the total, its super-linear part A (attention-like: terms of degree ≥ 2 in
    the size, power sums pₖ with k ≥ 2 of the families that move with it) and the rest B (linear in
    the size or independent of it), each labelled with its expression. Other symbols are held at
    ``values``; moving power sums follow ``segments`` (``"equal"``: n equal segments with n = p₁²/p₂
    from ``values``, pₖ = sizeᵏ/nᵏ⁻¹; ``"one"``: one segment, pₖ = sizeᵏ; an int n: n equal
    segments) — see the module docstring for both and for the exact crossover.

    A dashed vertical line marks the crossover (where A overtakes B, solved exactly, not read off
    the curves) when it lies in the range, annotated with its value; a dotted one marks the size of
    ``values`` if given. Defaults: ``lo``/``hi`` span 16x below the smaller and 16x above the larger
    of the ``values`` size and the crossover. Sampled sizes are snapped to sizes within the trace's
    guards.

    Returns the Figure, with ``fig.fxflops_crossover`` (the exact crossover, a sympy number, or
    None) and ``fig.fxflops_scaling`` (the :class:`ScalingSplit`, with ``crossover_int`` and
    ``note``); writes a PNG to ``path``.
    """
    convention = convention or program.convention
    split = scaling_split(
        program, symbol, values, segments=segments, families=families, phase=phase, convention=convention
    )
    anchors = [float(v) for v in (values.get(symbol), split.crossover) if v is not None and float(v) > 0]
    anchors = anchors or [1024.0]
    lo = int(lo) if lo is not None else max(1, math.floor(min(anchors) / 16))
    hi = int(hi) if hi is not None else max(lo + 1, math.ceil(max(anchors) * 16))
    if not 1 <= lo < hi:
        raise ValueError(f"need 1 <= lo < hi, got lo={lo}, hi={hi}")
    if points < 2:
        raise ValueError(f"points must be at least 2, not {points}")
    sizes = sample_sizes(split, lo, hi, points, log)
    parts = [split.at(m) for m in sizes]
    a = [float(p[0]) for p in parts]
    b = [float(p[1]) for p in parts]
    t = [u + v for u, v in zip(a, b)]

    def shown(ys: list[float]) -> list[float]:
        return [y if (y > 0 or not log) else float("nan") for y in ys]

    fig, ax, _ = _figure(ax, figsize, dpi)
    unit = "MACs" if convention.unit == "macs" else "FLOPs"
    ax.plot(sizes, shown(t), color="black", linewidth=2.2, label=f"total {unit}")
    if split.superlinear != 0:
        ax.plot(sizes, shown(a), color="tab:red", linewidth=1.6,
                label=f"super-linear in {symbol} (attention-like): {_short(split.superlinear)}")
    ax.plot(sizes, shown(b), color="tab:blue", linewidth=1.6,
            label=f"rest (linear in {symbol} or independent of it): {_short(split.rest)}")
    c = split.crossover
    if c is not None and sizes[0] <= float(c) <= sizes[-1]:
        cx = float(c)
        a_c = float(split.superlinear.xreplace({split.symbol: c}))
        ax.axvline(cx, color="tab:purple", linestyle="--", linewidth=1.2)
        ax.annotate(
            _crossover_text(split) + f"\nboth parts {human(int(a_c))}",
            xy=(cx, a_c), xytext=(12, -36), textcoords="offset points", fontsize=8, color="tab:purple",
            arrowprops={"arrowstyle": "->", "color": "tab:purple"},
        )
    elif c is not None:
        ax.text(0.99, 0.02, _crossover_text(split).replace("\n", " ") + " (outside the range)",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="tab:purple")
    else:
        ax.text(0.99, 0.02, f"no crossover: {split.note}", transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    at = values.get(symbol)
    if at is not None and sizes[0] <= at <= sizes[-1]:
        ax.axvline(at, color="tab:green", linestyle=":", linewidth=1.2, label=f"{symbol} = {at:,} (values)")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    meaning = program.describe_symbols().get(symbol, "")
    ax.set_xlabel(f"{symbol}" + (f" ({meaning})" if meaning else ""))
    ax.set_ylabel(unit)
    rules = "; ".join(_segments_text(name, n, symbol, segments) for name, n in split.segments.items())
    held = _values_text({k: v for k, v in split.held.items()})
    subtitle = ", ".join(p for p in (f"held {held}" if held else "", rules) if p)
    phase_text = f", phase {phase}" if phase else ""
    ax.set_title(
        f"{unit} vs {symbol}{phase_text}" + (f"\n{subtitle}" if subtitle else "") + "\n" + _convention_lines(convention, 110),
        fontsize=9,
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.fxflops_crossover = split.crossover
    fig.fxflops_scaling = split
    _save(fig, path)
    return fig


# ---- dispatch -------------------------------------------------------------------------------------
def plot(program: Program, kind: str = "breakdown", *args: Any, **kwargs: Any) -> Figure:
    """``plot(program, "breakdown", values, depth=2, ...)`` -> :func:`plot_breakdown`;
    ``plot(program, "scaling", symbol, values, ...)`` -> :func:`plot_scaling`. ``Program.plot``
    delegates here (``program.plot("scaling", "seq", {"batch": 8, "seq": 4096}, path="s.png")``)."""
    if kind == "breakdown":
        return plot_breakdown(program, *args, **kwargs)
    if kind == "scaling":
        return plot_scaling(program, *args, **kwargs)
    raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")


__all__ = [
    "KINDS",
    "SEGMENT_RULES",
    "ScalingSplit",
    "Segment",
    "breakdown_levels",
    "plot",
    "plot_breakdown",
    "plot_scaling",
    "scaling_split",
]
