"""The scaling split of a program's total FLOPs in one size: super-linear part, rest, exact crossover.

:func:`scaling_split` holds every other symbol at given values, moves the segment power sums of the
families that cut the varied size as ``segments=`` says, and splits the total into A(x) (terms of
degree ≥ 2 in x: attention cores, moving power sums pₖ, k ≥ 2) and B(x) (the rest); the crossover
where A overtakes B is computed exactly from A − B (real roots; per residue class for ``floor``
terms), never read off a curve. The maths, with its sources, is in ``docs/scaling.md``.
``fxflops/plot.py`` draws it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy
from sympy.polys.polyerrors import BasePolynomialError

from fxflops.errors import GuardError, UnboundSymbolError

if TYPE_CHECKING:
    from fxflops.conventions import Convention
    from fxflops.program import Program

SEGMENT_RULES = ("equal", "one")
_PERIOD_LIMIT = 10_000  # residue classes of floor terms we are willing to enumerate
_GUARD_SEARCH = 256  # integers tried past a sampled size that breaks a guard


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


def sample_sizes(split: ScalingSplit, lo: int, hi: int, points: int, log: bool) -> list[int]:
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
