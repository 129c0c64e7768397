"""Check a hand-written FLOPs formula against the traced program, term by term.

``fxflops.verify(program, formula, convention=MEGATRON)`` compares the program's closed form (under a
convention) with ``formula``:

* ``formula`` is a sympy expression in the program's symbols, or a Python callable whose parameters
  are symbol names. A callable is first called with sympy symbols (plain arithmetic gives a closed
  form, so the comparison is exact and symbolic); if that fails (``math.ceil``, ``if`` on a size, ...)
  it is sampled numerically instead.
* The **difference** traced − formula is attributed to modules: first whole module polynomials (or
  groups of same-shaped modules, ``visual.blocks.*.mlp``) that the difference contains as a multiple
  ("missing visual", "counted 4x: visual.merger"), then single monomials to the modules whose
  polynomials have them ("768*text_p2: language_model.layers.*.self_attn"); what is left is a term no
  traced module has (e.g. the ``tokens**2`` of a pack-length² approximation). Before that the
  equalities of ``program.relations`` are substituted (p₁ = the packed size its segments cover).
  A module missing whole while the rest is that module at another size is "counted at T′, traced T"
  (a merger's token count). A one-term match that another layer would explain with one of its own
  static sizes off by at most an eighth (``Term.dims``: a padded vocabulary) is reported as
  **ambiguous**, listing the explanations, smallest change of size first, never as one wrong module.
* The **relative error** is sampled over a domain of symbol values within the program's guards.
"""

from __future__ import annotations

import functools
import inspect
import random
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy
from torch.utils._sympy.functions import FloorDiv

from fxflops.analysis.counted import counted
from fxflops.analysis.paths import depth as path_depth
from fxflops.conventions import Convention

_PLAUSIBLE_RESIZE = sympy.Rational(1, 8)  # a formula's size off by at most this share is a resize, not a coincidence
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _plain(expr: sympy.Expr) -> sympy.Expr:
    """torch's FloorDiv as sympy ``floor`` so that a formula written with ``//`` compares equal."""
    return sympy.expand(sympy.sympify(expr).replace(FloorDiv, lambda a, b: sympy.floor(a / b)))


@dataclass(frozen=True)
class Attribution:
    """A part of the difference: ``expr`` = ``factor`` × the polynomial of ``where`` (or one monomial)."""

    where: str
    expr: sympy.Expr
    factor: sympy.Rational | None = None  # None: a single-monomial attribution
    sizes: tuple[sympy.Expr, sympy.Expr] | None = None  # (the formula's size, the traced one) of a whole module
    how: str = ""  # how the module explains a single-monomial term, e.g. "counted with size 512 where the model has 500"
    alternatives: tuple[str, ...] = ()  # other explanations of the same term: the attribution is ambiguous
    twins: tuple[str, ...] = ()  # other modules with the same polynomial: they explain it just as well

    def _explained(self, where: str | None = None) -> str:
        where = where or self.where
        if self.sizes is not None:
            return f"{where} counted at {self.sizes[0]}, traced {self.sizes[1]}"
        if self.factor is not None:  # a whole module, counted 1 - factor times
            times = 1 - self.factor
            return f"{where} left out" if times == 0 else f"{where} counted {times}x"
        return f"{where} {self.how}" if self.how else where

    def __str__(self) -> str:
        if self.alternatives or self.twins:
            coefficient, monomial = sympy.sympify(self.expr).as_coeff_Mul()
            word = "missing" if coefficient > 0 else "extra"
            what = f"{word} {abs(coefficient) * monomial}" if not monomial.is_Add else f"difference {self.expr}"
            others = [*(self._explained(twin) for twin in self.twins), *self.alternatives]
            shown = [self._explained(), *others[:2]]
            more = f" (or {len(others) - 2} more)" if len(others) > 2 else ""
            return f"ambiguous {what}: " + " or ".join(shown) + more
        if self.sizes is not None:
            return f"{self.where}: counted at {self.sizes[0]}, traced {self.sizes[1]} (the difference is {self.expr})"
        if self.factor is None:
            coefficient, monomial = sympy.sympify(self.expr).as_coeff_Mul()
            word = "missing" if coefficient > 0 else "extra"
            return f"{word} {abs(coefficient) * monomial}: {self._explained()}"
        times = 1 - self.factor  # the formula has ``times`` x the module's FLOPs
        if times == 0:
            return f"missing {self.where} (the formula leaves out {self.expr})"
        change = "extra" if self.factor < 0 else "missing"
        return f"counted {times}x: {self.where} ({change} {sympy.Abs(self.expr) if self.expr.is_number else -self.expr if self.factor < 0 else self.expr})"


@dataclass
class Verdict:
    """The result of :func:`verify`; ``str(verdict)`` is a readable report."""

    equal: bool
    difference: sympy.Expr | None  # traced - formula; None when the formula was only sampled
    traced: sympy.Expr
    formula: sympy.Expr | None
    convention: Convention
    attributions: list[Attribution] = field(default_factory=list)
    unexplained: sympy.Expr = sympy.Integer(0)
    relative_error: float = 0.0
    samples: int = 0

    @property
    def by_module(self) -> dict[str, sympy.Expr]:
        """Module path (or group ``a.*.b``) -> the part of the difference its polynomial explains."""
        parts: dict[str, sympy.Expr] = {}
        for a in self.attributions:
            parts[a.where] = parts.get(a.where, sympy.Integer(0)) + a.expr
        return parts

    def __str__(self) -> str:
        lines = [f"fxflops.verify under {self.convention.describe()}"]
        lines.append(f"  traced : {self.traced}")
        lines.append(f"  formula: {self.formula if self.formula is not None else '(sampled numerically)'}")
        if self.equal:
            lines.append("  EQUAL" + ("" if self.difference is not None else f" on {self.samples} samples"))
            return "\n".join(lines)
        if self.difference is not None:
            lines.append(f"  DIFFERENT: traced - formula = {self.difference}")
        else:
            lines.append("  DIFFERENT on the sampled domain (a numeric formula: no symbolic difference)")
        for attribution in self.attributions:
            lines.append(f"    {attribution}")
        if self.unexplained != 0:
            lines.append(f"    not in any traced module: {self.unexplained}")
        lines.append(f"  relative error over {self.samples} samples: max {100 * self.relative_error:.3g}%")
        return "\n".join(lines)


def _formula_expression(formula: Any, symbols: dict[str, sympy.Symbol]) -> sympy.Expr | None:
    """The formula as a sympy expression in the program's symbols, or None if it is numeric only."""
    if isinstance(formula, sympy.Basic):
        by_name = {sympy.Symbol(name): sym for name, sym in symbols.items()}
        return _plain(formula.xreplace({s: by_name.get(sympy.Symbol(s.name), s) for s in formula.free_symbols}))
    names = _parameters(formula, symbols)
    try:
        value = formula(**{name: symbols[name] for name in names})
        return _plain(sympy.sympify(value))
    except (TypeError, ValueError, AttributeError, sympy.SympifyError):
        return None


def _parameters(formula: Callable[..., Any], symbols: dict[str, sympy.Symbol]) -> list[str]:
    names = list(inspect.signature(formula).parameters)
    unknown = [n for n in names if n not in symbols]
    if unknown:
        raise ValueError(f"formula parameters {unknown} are not program symbols {sorted(symbols)}")
    return names


def _module_polynomials(program: Any, root: str, phase: str | None, convention: Convention) -> list[tuple[str, sympy.Expr]]:
    """(path or pattern, polynomial) for ``root`` first, then every module below it and every group
    of same-shaped modules (numeric path parts as ``*``), shallowest first."""
    polys: list[tuple[str, sympy.Expr]] = []
    groups: dict[str, list[sympy.Expr]] = defaultdict(list)
    for path in program.modules():
        poly = _plain(program.formula(path, phase, convention))
        if poly == 0 or path == root or not path.startswith(f"{root}." if root else ""):
            continue
        polys.append((path, poly))
        pattern = _INDEX.sub("*", path)
        if pattern != path:
            groups[pattern].append(poly)
    polys += [(pattern, sympy.expand(sum(members))) for pattern, members in groups.items() if len(members) > 1]
    polys.sort(key=lambda item: (path_depth(item[0]), "*" not in item[0]))
    return [(root or "<model>", _plain(program.formula(root, phase, convention))), *polys]


def _coincidences(
    where: str, part: sympy.Expr, named: list, dims_of: Callable[[str, sympy.Expr], set[int]] | None, bound: sympy.Rational | None
) -> list[tuple[sympy.Rational, str, str]]:
    """A whole-module match of a module whose polynomial is one term c·m is only a coefficient match:
    the other modules that would explain ``part`` with another static size, as ``_resized`` gives
    them (none: the match stands)."""
    terms = sympy.expand(part).as_coefficients_dict()
    if dims_of is None or len(terms) != 1:
        return []
    ((monomial, coefficient),) = terms.items()
    return [(change, w, how) for change, w, how in _resized(monomial, coefficient, _holders(named, monomial), dims_of, bound) if not _related(w, where)]


def _whole_module(where: str, r: sympy.Rational, poly: sympy.Expr, named: list, dims_of: Callable | None) -> Attribution:
    """``r``·(the polynomial of ``where``) of the difference as one attribution: the module left out
    (r = 1) or counted 1 − r times. A module counted k times explains a one-term difference no
    better than any other module counted with one size changed (a padded vocabulary in ``lm_head``
    gives the same term as one projection counted twice): such matches are ambiguous, whatever the
    size change, and the explanation that changes its module's count the least comes first.
    Leaving a module out (the commonest formula bug) stays first. Another module with the very same
    polynomial (Qwen3-VL's merger and its one deepstack merger) is a twin: ambiguous too."""
    part = sympy.expand(r * poly)
    terms = sympy.expand(poly).as_coefficients_dict()
    # one member of a repeated stack (an indexed path) is never a hand formula's unit: not a twin
    twins = tuple(w for w, other in named if other == terms and w != where and not _related(w, where) and not _INDEX.search(w))
    alternatives = _coincidences(where, part, named, dims_of, None if r <= -1 else _PLAUSIBLE_RESIZE)
    described = tuple(f"{w} {how}" for _, w, how in alternatives)
    if r <= -1 and alternatives and alternatives[0][0] < abs(r):  # the module counted 1 - r times changes it by |r|
        _, first, how = alternatives[0]
        counted = (Attribution(where, part, r)._explained(), *(Attribution(w, part, r)._explained() for w in twins))
        return Attribution(first, part, how=how, alternatives=(*counted, *described[1:]))
    return Attribution(where, part, r, alternatives=described, twins=twins)


def _in_module(path: str, where: str, inside: bool = False) -> bool:
    """``path`` is the module ``where`` or, for a group (``layers.*.mlp``), one of its members; with
    ``inside``, also a submodule of it."""
    pattern = "[^.]+".join(re.escape(part) for part in where.split("*"))
    return re.fullmatch(pattern + (r"(\..+)?" if inside else ""), path) is not None


def _holders(named: list, monomial: sympy.Expr) -> list[tuple[str, sympy.Expr]]:
    """(module, its coefficient of ``monomial``) for every module whose polynomial has it."""
    return [(w, terms[monomial]) for w, terms in named if monomial in terms]


def _related(a: str, b: str) -> bool:
    """One module (or group) is the other, inside it or one of its members."""
    return _in_module(a, b, inside=True) or _in_module(b, a, inside=True)


def _multiple(difference: sympy.Expr, poly: sympy.Expr) -> sympy.Integer | None:
    """Integer r if ``difference`` contains r·``poly`` term for term (every monomial, same ratio): the
    formula counts that module 1 - r times."""
    d_terms, p_terms = difference.as_coefficients_dict(), poly.as_coefficients_dict()
    ratio = None
    for monomial, coefficient in p_terms.items():
        if monomial not in d_terms:
            return None
        r = sympy.Rational(d_terms[monomial]) / sympy.Rational(coefficient)
        if ratio is None:
            ratio = r
        elif r != ratio:
            return None
    # the formula counts the module 1 - r times: r = 1 (left out) or r <= -1 (counted 2x, 3x, ...)
    return ratio if ratio is not None and ratio.is_integer and (ratio == 1 or ratio <= -1) else None


def _at_another_size(a: Attribution, rest: sympy.Expr, related_only: bool) -> Attribution | None:
    """A module (or one term of it) found missing, c·T(x), while the rest of the difference is
    −c·T′(x): the formula counts that module at another size T′ (a merger at 5·⌊P/20⌋ tokens
    instead of ⌊P/4⌋, attention over an average image P²/B instead of Σ sᵢ², a projector at the
    patches before pooling). T′ must be in the sizes of T, or T in those of T′ (``related_only``),
    or (else) one term. Both sizes are shown with the smallest integer coefficients: c's content
    moves into them (``16*images`` tokens, not ``images``). ``None`` when it is not so."""
    missing = a.factor == 1 or (a.factor is None and not a.alternatives and sympy.sympify(a.expr).as_coeff_Mul()[0] > 0)
    if rest == 0 or not missing:
        return None
    content, traced = sympy.sympify(a.expr).as_content_primitive()
    counted = sympy.expand(-rest / content)  # the formula has c·T′ where the program has c·T
    related = counted.free_symbols <= traced.free_symbols or traced.free_symbols <= counted.free_symbols
    one_term = len(sympy.Add.make_args(counted)) == 1 and counted.as_coeff_Mul()[0] > 0
    if counted == 0 or sympy.expand(counted - traced) == 0 or not (related if related_only else related or one_term):
        return None
    scale = functools.reduce(sympy.ilcm, (sympy.fraction(c)[1] for c in counted.as_coefficients_dict().values()), 1)
    if not (content / scale).is_integer:
        return None
    sizes = (sympy.expand(scale * counted), sympy.expand(scale * traced))
    return Attribution(a.where, sympy.expand(a.expr + rest), sizes=sizes, twins=a.twins)


def _restated(found: list[Attribution], rest: sympy.Expr, related_only: bool) -> tuple[list[Attribution], sympy.Expr]:
    """The attributions with the first missing one that ``rest`` restates at another size
    (``_at_another_size``) restated, and the rest left; unchanged when none does."""
    for i, a in enumerate(found):
        restated = _at_another_size(a, rest, related_only)
        if restated is not None:
            return [*found[:i], restated, *found[i + 1 :]], sympy.Integer(0)
    return found, rest


def _resized(
    monomial: sympy.Expr, coefficient: sympy.Expr, holders: list[tuple[str, sympy.Expr]], dims_of: Callable[[str, sympy.Expr], set[int]],
    bound: sympy.Rational | None = _PLAUSIBLE_RESIZE,
) -> list[tuple[sympy.Rational, str, str]]:
    """Modules (or groups) that explain ``coefficient·monomial`` as one of their static sizes s
    counted as another integer s′ = s·(c − d)/c, within ``bound`` of s (``None``: any; a padded
    vocabulary in ``lm_head``, a hidden size rounded): (relative change, where, how), a group
    instead of its members, the deepest of a chain; the smallest change of size first."""
    found: dict[str, tuple[sympy.Rational, str]] = {}  # where -> (smallest relative change, how)
    for where, c in holders:
        ratio = (c - coefficient) / c  # the formula's size over the model's
        if bound is not None and abs(ratio - 1) > bound:
            continue
        sizes = [s for s in sorted(dims_of(where, monomial)) if (s * ratio).is_integer and 0 < s * ratio != s]
        if sizes:
            found[where] = (abs(ratio - 1), "counted with size " + " or ".join(f"{s * ratio} where the model has {s}" for s in sizes))
    groups = [w for w in found if "*" in w]
    kept = [w for w in found if not any(g != w and _in_module(w, g) for g in groups)]
    kept = [w for w in kept if not any(o != w and o.startswith(w + ".") for o in kept)]  # deepest
    return [(found[w][0], w, found[w][1]) for w in sorted(kept, key=lambda w: (found[w][0], w))]


def attribute(
    difference: sympy.Expr, modules: list[tuple[str, sympy.Expr]], dims_of: Callable[[str, sympy.Expr], set[int]] | None = None
) -> tuple[list[Attribution], sympy.Expr]:
    """Explain ``difference`` by structure first, then by coefficient:

    1. whole module polynomials (the model first, then shallowest modules): left out, or counted k
       times (``_whole_module``); a module left out while the rest is that module at another,
       related size is restated so at once (``_at_another_size``), before any coincidence;
    2. a module left out while no term of the rest has a module of its own: restated at another size;
    3. monomial by monomial (``_by_monomial``);
    4. a missing module or term whose size the unexplained rest restates.

    Returns the attributions and the unexplained rest."""
    found: list[Attribution] = []
    rest = sympy.expand(difference)
    named = [(w, p.as_coefficients_dict()) for w, p in modules[1:]]
    for where, poly in modules:
        r = _multiple(rest, poly) if rest != 0 else None
        if r is not None and r != 0:
            found.append(_whole_module(where, r, poly, named, dims_of))
            rest = sympy.expand(rest - found[-1].expr)
            restated = _at_another_size(found[-1], rest, related_only=True) if found[-1].factor == 1 else None
            if restated is not None:
                found[-1], rest = restated, sympy.Integer(0)
    if rest != 0 and not any(_by_monomial(m, c, named, dims_of, owned_only=True) for m, c in rest.as_coefficients_dict().items()):
        found, rest = _restated(found, rest, related_only=False)
    unexplained = sympy.Integer(0)
    for monomial, coefficient in rest.as_coefficients_dict().items():
        attribution = _by_monomial(monomial, coefficient, named, dims_of)
        if attribution is None:
            unexplained += coefficient * monomial
        else:
            found.append(attribution)
    return _restated(found, unexplained, related_only=False)


def _by_monomial(
    monomial: sympy.Expr, coefficient: sympy.Expr, named: list, dims_of: Callable | None, owned_only: bool = False
) -> Attribution | None:
    """One term of the difference: the deepest module (or group) holding exactly that term, or one
    whose static size (``dims_of``) the formula changed — when both, or several, fit, the
    attribution is ambiguous and lists them; else (unless ``owned_only``) the top-level modules if
    together they hold exactly it; else (a part of a term) the deepest modules holding it. ``None``:
    no module holds it."""
    holders = _holders(named, monomial)
    exact = [w for w, c in holders if c == coefficient or c == -coefficient]
    chosen = None
    if exact:
        deepest = max(map(path_depth, exact))
        candidates = sorted(w for w in exact if path_depth(w) == deepest)
        chosen = next((w for w in candidates if "*" in w), candidates[0])
    resized = _resized(monomial, coefficient, holders, dims_of) if dims_of is not None else []
    others = [(w, how) for _, w, how in resized if chosen is None or not _related(w, chosen)]
    described = tuple(f"{w} {how}" for w, how in others)
    if chosen is not None:
        return Attribution(chosen, coefficient * monomial, alternatives=described)
    if others:
        return Attribution(others[0][0], coefficient * monomial, how=others[0][1], alternatives=described[1:])
    if not holders or owned_only:
        return None
    top = [(w, c) for w, c in holders if "." not in w and "*" not in w]
    if abs(sum(c for _, c in top)) == abs(coefficient):  # the term of the top-level modules together
        return Attribution(", ".join(sorted(w for w, _ in top)), coefficient * monomial)
    deepest = max(path_depth(w) for w, _ in holders)  # a part of the term: where it is computed, the deepest holders
    at = sorted(w for w, _ in holders if path_depth(w) == deepest)
    return Attribution(", ".join([w for w in at if "*" in w][:1] or at), coefficient * monomial)


def _static_sizes(program: Any, convention: Convention, equal_to: dict) -> Callable[[str, sympy.Expr], set[int]]:
    """``dims_of(where, monomial)``: the static sizes every counted term of module (or group)
    ``where`` with that monomial shares (``Term.dims``): the sizes a formula may have changed. Only
    for a module whose own ops (not its submodules') hold the monomial: a layer, not a block."""

    def dims_of(where: str, monomial: sympy.Expr) -> set[int]:
        inner = [
            t for t in program.terms
            if _in_module(t.module, where, inside=True)
            and any(True for _ in counted([t], convention))
            and monomial in _plain(t.flops).xreplace(equal_to).as_coefficients_dict()
        ]
        if not inner or not all(_in_module(t.module, where) for t in inner):  # ops of its own only
            return set()
        return set.intersection(*(set(t.dims) for t in inner))

    return dims_of


def _equalities(program: Any) -> dict[sympy.Symbol, sympy.Expr]:
    """The relations that are equalities (``program.relations``: p₁ = the packed size its segments
    cover, p₀ = offsets − 1), as a substitution of the power sum by the size."""
    found = {}
    for relation in getattr(program, "relations", []):
        if isinstance(relation, sympy.Equality) and isinstance(relation.lhs, sympy.Symbol) and relation.lhs not in found:
            found[relation.lhs] = relation.rhs
    return found


def _sample(program: Any, domain: dict[str, tuple[int, int]] | None, n: int, seed: int) -> list[dict[str, int]]:
    """``n`` points of symbol values within the program's guards. Power sums come from random segment
    lengths; a family whose segments must cover (or fit in) a sampled size is cut from that size."""
    rng = random.Random(seed)
    domain = domain or {}
    families = sorted(program.families, key=lambda f: f.name)
    powers = program.power_sums  # name -> (family, k)
    names = [str(s) for s in program.symbols]
    points: list[dict[str, int]] = []
    for _ in range(50 * n):
        if len(points) == n:
            break
        point = {name: rng.randint(*domain.get(name, (1, 4096))) for name in names if name not in powers}
        for family in families:
            lengths = _segments(rng, family, point, domain)
            for name in names:
                if powers.get(name, ("",))[0] == family.name:
                    point[name] = sum(length ** powers[name][1] for length in lengths)
        ordered = tuple(point.get(str(s), 0) for s in program.all_symbols)
        if program.within_guards(*ordered):
            points.append(point)
    return points


def _segments(rng: random.Random, family: Any, point: dict[str, int], domain: dict) -> list[int]:
    """Random segment lengths for ``family``: summing to the size it must cover, at most the size it
    cuts, or free (``<family>_count`` segments of ``<family>_length``)."""
    count = rng.randint(*domain.get(f"{family.name}_count", (1, 16)))
    for sizes, exact in ((family.covered, True), (family.packed, False)):
        for size in sorted(sizes, key=str):
            if isinstance(size, sympy.Symbol) and str(size) in point:
                total = point[str(size)] if exact else rng.randint(1, point[str(size)])
                cuts = sorted(rng.sample(range(1, total), min(count, total) - 1)) if total > 1 else []
                bounds = [0, *cuts, total]
                return [b - a for a, b in zip(bounds, bounds[1:])]
    return [rng.randint(*domain.get(f"{family.name}_length", (1, 512))) for _ in range(count)]


def verify(
    program: Any,
    formula: Any,
    *,
    convention: Convention | None = None,
    phase: str | None = None,
    module: str = "",
    domain: dict[str, tuple[int, int]] | None = None,
    samples: int = 200,
    seed: int = 0,
) -> Verdict:
    """Compare ``formula`` with the program's FLOPs under ``convention`` (see the module docstring):
    the whole model, or the subtree at ``module`` (e.g. ``"visual"`` against a ViT formula).

    ``domain`` bounds the sampled symbol values (``{"tokens": (1, 8192)}``; for a segment family
    ``<family>_count`` and ``<family>_length`` bound the random segments its power sums come from).
    """
    convention = convention or program.convention
    symbols = {str(s): s for s in program.all_symbols}
    equal_to = _equalities(program)
    traced = _plain(program.formula(module, phase, convention)).xreplace(equal_to)
    expression = _formula_expression(formula, symbols)
    expression = None if expression is None else sympy.expand(expression.xreplace(equal_to))
    points = _sample(program, domain, samples, seed)
    traced_f = sympy.lambdify(list(symbols.values()), traced, "math") if points else None
    if expression is not None:
        difference = sympy.expand(traced - expression)
        diff_f = sympy.lambdify(list(symbols.values()), difference, "math")
        errors = [abs(diff_f(*[p.get(n, 0) for n in symbols])) / max(abs(traced_f(*[p.get(n, 0) for n in symbols])), 1) for p in points]
        equal = difference == 0 or (bool(difference.atoms(sympy.floor)) and bool(points) and max(errors) == 0)
        modules = [(where, sympy.expand(poly.xreplace(equal_to))) for where, poly in _module_polynomials(program, module, phase, convention)]
        dims_of = _static_sizes(program, convention, equal_to)
        found, unexplained = ([], sympy.Integer(0)) if equal else attribute(difference, modules, dims_of)
        return Verdict(equal, difference, traced, expression, convention, found, unexplained, max(errors, default=0.0), len(points))
    names = _parameters(formula, symbols)
    errors = []
    for p in points:
        want = traced_f(*[p.get(n, 0) for n in symbols])
        got = formula(**{n: p[n] for n in names})
        errors.append(abs(want - got) / max(abs(want), 1))
    return Verdict(max(errors, default=0.0) == 0, None, traced, None, convention, relative_error=max(errors, default=0.0), samples=len(points))
