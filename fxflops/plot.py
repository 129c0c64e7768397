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

Power-sum scaling
-----------------
Segment power sums ``<family>_p<k>`` = pₖ = Σᵢ sᵢᵏ (the lengths sᵢ of the packed sequences of
``cu_seqlens``, of the frames of ``image_grid_thw``) are separate symbols of a program, but they are
not independent of the packed size they cut: when ``tokens`` grows the text sequences grow with it.
A family *moves with* the varied size when the trace recorded that its segments cut that size
(``family.packed``/``family.covered``: ``text`` cuts ``tokens``, ``frames`` cuts ``patches``), or when
it is named in ``families=``; every other family's power sums stay at their ``values``. How a moving
family's segments grow is ``segments=``:

* ``"equal"`` (default): the size ``x`` is cut into a **fixed number n of equal segments**, each of
  length ``x/n``: p₁ = x, pₖ = n·(x/n)ᵏ = xᵏ/nᵏ⁻¹. n comes from ``values``: n = p₁²/p₂, with p₁ the
  family's ``_p1`` value if given, else the value of the varied size itself (no padding), and p₂ the
  family's ``_p2`` value (if p₂ is absent, the lowest given pₖ: n = (p₁ᵏ/pₖ)^(1/(k-1))). For equal
  segments this is exactly their number; for unequal ones it is the effective number
  (Cauchy–Schwarz: p₁²/p₂ ≤ n), the one for which the curve passes through the given p₂. So the
  attention-like work of a packed dimension grows as x²/n, not x².
* ``"one"``: a single segment spanning the whole size: pₖ = xᵏ (n = 1; the pack-length² view).
* an ``int`` n: n equal segments, n given explicitly (pₖ = xᵏ/nᵏ⁻¹).

Super-linear part and crossover
-------------------------------
With every other symbol replaced (held values, moving power sums as above) the total is an exact
expression F(x) in the varied size x: a polynomial with rational coefficients, possibly with
``floor``/``ceiling`` terms (``patches // 4`` of a 2×2 merger). Each additive term is classified by
its growth degree in x (``floor(u)`` grows as ``u``):

* A(x), the **super-linear** part: terms of degree ≥ 2 — attention cores (``batch*seq**2``) and the
  power sums pₖ, k ≥ 2, of a moving family (pₖ ∝ xᵏ);
* B(x), the **rest**: terms of degree ≤ 1 — the projections, MLPs and heads linear in x, plus every
  term that does not depend on x at all (e.g. the vision tower when ``tokens`` varies).

The crossover is where A overtakes B, computed from D(x) = A(x) − B(x), never read off the curves:

* polynomial D: ``crossover`` is the largest positive real root of D at which D changes sign
  (``sympy.Poly.real_roots``: an exact Integer, Rational, radical or ``CRootOf``); A > B beyond it.
  For TinyGPT with ``batch`` held, D = 768·b·s² − 585216·b·s and the crossover is s = 585216/768
  = 762 exactly.
* D with ``floor``/``ceiling`` of a polynomial u(x) with rational coefficients: write u = g/q with g
  integer-coefficient; g(x) mod q depends only on x mod q, so on every residue class x ≡ j (mod P)
  (P the lcm of the q's) ``floor(u(x)) = u(x) − frac(u(j))`` exactly and D is a polynomial Dⱼ there.
  The curves are step functions, so the crossover is reported on the integers: ``crossover`` is
  then ``crossover_int``.

``crossover_int`` (always computed) is the smallest integer n ≥ 1 with A(m) ≥ B(m) for every integer
m ≥ n: one past the largest integer at which D < 0, found exactly per residue class from the real
roots of Dⱼ (ceil(r) for a polynomial D with a sign-changing largest root r). Both are ``None`` when A
never overtakes B (no super-linear part, or D eventually negative); ``crossover`` is also ``None``
when A ≥ B at every positive size (``crossover_int`` is then 1). ``ScalingSplit.note`` says which.

The polynomials hold under the trace's guards (``program.guards``): the plotted sizes are snapped to
the next integer sizes that satisfy them (e.g. multiples of 4 for ``patches`` of a 2×2 merger); the
crossover is a property of the polynomial and is computed without them.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy
from sympy.polys.polyerrors import BasePolynomialError

from fxflops.analysis.paths import depth as path_depth
from fxflops.errors import GuardError, UnboundSymbolError
from fxflops.report import human

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from fxflops.conventions import Convention
    from fxflops.program import Program

SEGMENT_RULES = ("equal", "one")
KINDS = ("breakdown", "scaling")
DPI = 100
_PERIOD_LIMIT = 10_000  # residue classes of floor terms we are willing to enumerate
_GUARD_SEARCH = 256  # integers tried past a sampled size that breaks a guard


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
@dataclass(frozen=True)
class ScalingSplit:
    """The total FLOPs as an exact expression in one size, split as the module docstring says.

    ``symbol``: the varied size. ``total`` = ``superlinear`` + ``rest`` (sympy, in ``symbol`` only).
    ``held``: the value each other symbol was given; ``laws``: the expression each moving power sum
    became; ``segments``: family name -> number of segments n used. ``crossover``: exact sympy number
    (or None), ``crossover_int``: int (or None) — see the module docstring; ``note`` says why one is
    None or how it was computed.
    """

    symbol: sympy.Symbol
    total: sympy.Expr
    superlinear: sympy.Expr
    rest: sympy.Expr
    held: dict[str, int]
    laws: dict[str, sympy.Expr]
    segments: dict[str, sympy.Expr]
    crossover: sympy.Expr | None
    crossover_int: int | None
    note: str = ""
    exact: bool = True
    _guard: Any = field(default=None, repr=False, compare=False)

    def at(self, size: int) -> tuple[sympy.Rational, sympy.Rational]:
        """(super-linear part, rest) at an integer size, exactly."""
        x = {self.symbol: sympy.Integer(size)}
        return self.superlinear.xreplace(x), self.rest.xreplace(x)


def _normalised(expr: sympy.Expr) -> sympy.Expr:
    """torch's integer sympy functions as plain sympy: FloorDiv -> floor, CeilDiv -> ceiling, exact
    divisions -> ``/``, Mod -> a − b·floor(a/b), PowByNatural -> ``**``."""
    from torch.utils._sympy import functions as tf

    rewrites = {
        "FloorDiv": lambda a, b: sympy.floor(a / b),
        "CeilDiv": lambda a, b: sympy.ceiling(a / b),
        "CleanDiv": lambda a, b: a / b,
        "IntTrueDiv": lambda a, b: a / b,
        "Mod": lambda a, b: a - b * sympy.floor(a / b),
        "PythonMod": lambda a, b: a - b * sympy.floor(a / b),
        "PowByNatural": lambda a, b: a**b,
    }
    for name, rewrite in rewrites.items():
        cls = getattr(tf, name, None)
        if cls is not None:
            expr = expr.replace(lambda e, cls=cls: isinstance(e, cls), lambda e, r=rewrite: r(*e.args))
    expr = expr.replace(lambda e: isinstance(e, sympy.Mod), lambda e: e.args[0] - e.args[1] * sympy.floor(e.args[0] / e.args[1]))
    return expr


def _steps(expr: sympy.Expr, x: sympy.Symbol) -> list[sympy.Expr]:
    """The floor/ceiling atoms of ``expr`` that depend on ``x``."""
    return [a for a in expr.atoms(sympy.floor, sympy.ceiling) if a.has(x)]


def _growth(term: sympy.Expr, x: sympy.Symbol) -> int:
    """Degree of growth of one additive term in x (floor(u), ceiling(u) grow as u)."""
    smooth = term.replace(lambda e: isinstance(e, (sympy.floor, sympy.ceiling)), lambda e: e.args[0])
    if not smooth.is_polynomial(x):
        raise ValueError(f"cannot split the FLOPs term {term} by its growth in {x}: not a polynomial in {x}")
    return int(sympy.degree(smooth, x)) if smooth.has(x) else 0


class _Never(Exception):
    """D(x) is eventually negative on a residue class: the super-linear part never overtakes."""


def _last_negative(poly: sympy.Poly, period: int, j: int) -> int | None:
    """The largest integer m >= 1, m ≡ j (mod period), with poly(m) < 0; None if there is none.

    poly has constant sign between consecutive real roots, so for the roots r from the largest down
    the candidate is c = the largest m ≡ j with m < r: the first candidate with poly(c) < 0 is the
    answer (a larger negative m would lie below a larger root and have been a candidate before)."""
    if poly.is_zero or poly.LC() < 0:
        raise _Never
    if poly.degree() == 0:
        return None
    for root in sorted(set(poly.real_roots()), reverse=True):
        below = int(sympy.ceiling(root)) - 1
        candidate = below - (below - j) % period
        if candidate < 1:
            return None
        if poly.eval(candidate) < 0:
            return candidate
    return None


def _crossover(diff: sympy.Expr, x: sympy.Symbol) -> tuple[sympy.Expr | None, int | None, str]:
    """(crossover, crossover_int, note) of D = A − B; see the module docstring."""
    steps = _steps(diff, x)
    period, inner = 1, {}
    for atom in steps:
        u = atom.args[0]
        if _steps(u, x) or not u.is_polynomial(x):
            raise ValueError(f"cannot solve for the crossover: {atom} is not floor/ceiling of a polynomial in {x}")
        coeffs = sympy.Poly(u, x).all_coeffs()
        if not all(c.is_Rational for c in coeffs):
            raise ValueError(f"cannot solve for the crossover: {atom} has non-rational coefficients")
        q = math.lcm(1, *(int(c.q) for c in coeffs))
        inner[atom] = u
        period = math.lcm(period, q)
    if period > _PERIOD_LIMIT:
        raise ValueError(f"cannot solve for the crossover: the floor terms repeat only every {period} sizes")
    last = None
    try:
        for j in range(period):
            replaced = {}
            for atom, u in inner.items():
                at_j = u.xreplace({x: sympy.Integer(j)})
                replaced[atom] = u - (at_j - sympy.floor(at_j)) if isinstance(atom, sympy.floor) else u + (sympy.ceiling(at_j) - at_j)
            poly = sympy.Poly(sympy.expand(diff.xreplace(replaced)), x)
            m = _last_negative(poly, period, j)
            if m is not None and (last is None or m > last):
                last = m
    except _Never:
        return None, None, f"the super-linear part never overtakes the rest as {x} grows"
    crossover_int = 1 if last is None else last + 1
    if steps:
        return sympy.Integer(crossover_int), crossover_int, (
            f"{x} has floor/ceiling terms: crossover on the integers (residue classes mod {period})"
        )
    poly = sympy.Poly(diff, x)
    roots = poly.real_roots()  # with multiplicity
    changes = [r for r in set(roots) if r > 0 and roots.count(r) % 2 == 1]
    if not changes:
        return None, crossover_int, f"the super-linear part is at least the rest at every {x} > 0"
    return max(changes), crossover_int, "largest positive real root of superlinear - rest"


def scaling_split(
    program: Program,
    symbol: str,
    values: dict[str, int],
    *,
    segments: str | int = "equal",
    families: Iterable[str] | None = None,
    phase: str | None = None,
    convention: Convention | None = None,
) -> ScalingSplit:
    """The total FLOPs of ``program`` as an exact expression in the size ``symbol``, every other
    symbol held at ``values`` and the power sums of the moving families following ``segments``,
    split into its super-linear part and the rest, with the exact crossover (module docstring).

    ``families``: segment families whose power sums move with ``symbol`` (default: those whose
    segments the trace saw cut ``symbol``). Raises ValueError for an unknown ``symbol`` (naming the
    valid ones), a power-sum ``symbol``, an unknown family or ``segments`` rule, or a value name that
    is not a symbol of the program; UnboundSymbolError for a held symbol without a value.
    """
    convention = convention or program.convention
    powers = program.power_sums
    sizes = [str(s) for s in program.required_symbols(convention) if str(s) not in powers]
    if symbol not in sizes:
        why = (
            f"{symbol!r} is a segment power sum; vary the size it cuts and choose how its segments grow "
            "with segments='equal'|'one'|n"
            if symbol in powers
            else f"unknown size symbol {symbol!r}"
        )
        raise ValueError(f"{why}; the size symbols of this program are {sizes}")
    if not (segments in SEGMENT_RULES or (isinstance(segments, int) and not isinstance(segments, bool) and segments > 0)):
        raise ValueError(f"segments must be one of {SEGMENT_RULES} or a positive number of segments, not {segments!r}")
    known = {str(s) for s in program.all_symbols}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown symbol(s) {unknown} in values; the program's symbols are {sorted(known)}")
    x = next(s for s in program.all_symbols if str(s) == symbol)
    by_name = {f.name: f for f in program.families}
    if families is None:
        moving = [f.name for f in program.families if x in (f.packed | f.covered)]
    else:
        moving = list(families)
        bad = [f for f in moving if f not in by_name]
        if bad:
            raise ValueError(f"unknown segment famil(ies) {bad}; the program's families are {sorted(by_name)}")

    formula = _normalised(program.formula("", phase, convention))
    used = {str(s) for s in formula.free_symbols}
    counts: dict[str, sympy.Expr] = {}
    for name in moving:
        if not any(powers.get(s, ("",))[0] == name and powers[s][1] >= 2 for s in used):
            continue
        if segments == "one":
            counts[name] = sympy.Integer(1)
        elif isinstance(segments, int):
            counts[name] = sympy.Integer(segments)
        else:
            counts[name] = _segment_count(name, symbol, values, powers)
    laws: dict[str, sympy.Expr] = {}
    held: dict[str, int] = {}
    subs: dict[sympy.Symbol, sympy.Expr] = {}
    missing = []
    for sym in formula.free_symbols:
        name = str(sym)
        if sym == x:
            continue
        family, k = powers.get(name, (None, 0))
        if family in moving:
            n = counts.get(family, sympy.Integer(1))
            subs[sym] = laws[name] = x**k / n ** (k - 1)
        elif name in values:
            subs[sym] = sympy.Integer(int(values[name]))
            held[name] = int(values[name])
        else:
            missing.append(name)
    if missing:
        raise UnboundSymbolError(
            f"no value for symbol(s) {sorted(missing)}, held fixed while {symbol} varies; pass them in values"
        )
    total = sympy.expand(formula.xreplace(subs))
    superlinear, rest = sympy.Integer(0), sympy.Integer(0)
    for term in sympy.Add.make_args(total):
        if _growth(term, x) >= 2:
            superlinear += term
        else:
            rest += term
    exact = True
    if superlinear == 0:
        crossover, crossover_int, note = None, None, f"no term grows faster than linearly in {symbol}"
    else:
        try:
            crossover, crossover_int, note = _crossover(sympy.expand(superlinear - rest), x)
        except (ValueError, NotImplementedError, BasePolynomialError) as exc:
            crossover, crossover_int, note, exact = None, None, f"crossover not computed: {exc}", False
    ordered_values = {str(s): int(values.get(str(s), 0)) for s in program.all_symbols}
    return ScalingSplit(
        x, total, superlinear, rest, held, laws, counts, crossover, crossover_int, note, exact,
        _guard=(program, ordered_values),
    )


def _segment_count(family: str, symbol: str, values: dict[str, int], powers: dict[str, tuple[str, int]]) -> sympy.Expr:
    """n = p₁²/p₂ from ``values`` (module docstring), or from the lowest given pₖ (``powers``:
    ``program.power_sums``)."""
    of_family = {k: name for name, (f, k) in powers.items() if f == family}
    p1 = values.get(of_family.get(1, f"{family}_p1"), values.get(symbol))
    given = sorted((k, values[name]) for k, name in of_family.items() if k >= 2 and name in values)
    if p1 is None or not given:
        raise ValueError(
            f"segments='equal' keeps the number of {family!r} segments of the values: give {symbol} (or "
            f"{family}_p1) and {family}_p2 in values, or pass segments=n (n equal segments) or segments='one'"
        )
    k, pk = given[0]
    if pk <= 0:
        raise ValueError(f"{family}_p{k} must be positive to give a number of segments, not {pk}")
    return sympy.root(sympy.Rational(int(p1) ** k, int(pk)), k - 1)


def _sizes(split: ScalingSplit, lo: int, hi: int, points: int, log: bool) -> list[int]:
    """Integer sizes from lo to hi (geometric when ``log``), each snapped to the next size within
    the program's guards; GuardError if none is."""
    import numpy as np

    program, ordered = split._guard
    raw = np.geomspace(lo, hi, points) if log else np.linspace(lo, hi, points)
    names = [str(s) for s in program.all_symbols]
    candidates = sorted({round(float(v)) for v in raw} | {lo, hi})
    chosen: list[int] = []
    for m in candidates:
        for size in range(max(m, chosen[-1] + 1 if chosen else 1), m + _GUARD_SEARCH):
            row = dict(ordered, **{str(split.symbol): size})
            for name, law in split.laws.items():
                row[name] = int(sympy.floor(law.xreplace({split.symbol: sympy.Integer(size)}) + sympy.S.Half))
            if program.within_guards(*(row[n] for n in names)):
                chosen.append(size)
                break
    if not chosen:
        row = dict(ordered, **{str(split.symbol): lo})
        raise GuardError(
            f"no size of {split.symbol} in [{lo}, {hi}] satisfies the trace's guards: "
            + program.explain_guard_failure(tuple(row[n] for n in names))
        )
    return chosen


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
    sizes = _sizes(split, lo, hi, points, log)
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
