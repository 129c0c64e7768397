"""Program: the traced model's FLOPs as exact polynomials per module, compiled for evaluation.

Built from a capture's :class:`~fxflops.analysis.Analysis` (every node's term, ``fxflops/analysis/``):
terms roll up into the module tree of ``model.named_modules()``; a module called twice sums both calls.

Evaluation uses a monomial basis (:class:`Basis`): every module/phase total is a linear combination
``C · m(x)`` of a few monomials ``m(x)`` (``seq``, ``seq**2``, ``batch*seq``, ...). A call evaluates
``m(x)`` once (cost independent of the number of modules) and any breakdown is a dot product at read
time. Coefficients are scaled by their common denominator: everything stays in exact Python integers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import networkx as nx
import sympy
import torch

from fxflops.analysis import Analysis, analyze
from fxflops.analysis.counted import PHASES, checked_phase, convention_terms
from fxflops.analysis.paths import ancestors, depth as path_depth
from fxflops.analysis.segments import derived_family
from fxflops.analysis.terms import Term, Unsupported
from fxflops.binder import VALID, Binder, generated, python_source
from fxflops.call_keys import CallKeys
from fxflops.capture.derived import CountedSize, DerivedSize, RowSum, refuse_every_op_count
from fxflops.capture.inputs import path_label
from fxflops.conventions import FLOPCOUNTER, Convention, as_convention
from fxflops.errors import GuardError, InputError, MetadataError, UnboundSymbolError
from fxflops.guards import OUTSIDE, OUTSIDE_KEY, checks as guard_checks
from fxflops.situation import ModelState, describe_difference

if TYPE_CHECKING:
    from fxflops.capture.trace import Captured, Guard

__all__ = ["BACKWARD_RULES", "PHASES", "Basis", "Program", "Term", "Unsupported", "backward_rule"]

BACKWARD_RULES = ("none", "traced", "2x")
_CALLS, _MEASURED = sympy.Symbol("calls"), sympy.Symbol("measured_calls")  # bookkeeping columns of MoE programs


def backward_rule(backward: bool | str) -> str:
    """``False`` -> ``"none"``, ``True`` -> ``"traced"``; ``"traced"``/``"2x"``/``"none"`` as they are."""
    return ("traced" if backward else "none") if isinstance(backward, bool) else backward


def _identity(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, kwargs


def _exact_int(value: Any) -> int:
    """A monomial value as a Python int (a 0-d tensor from device metadata is read: a sync)."""
    return int(value.item()) if isinstance(value, torch.Tensor) else value


class Basis:
    """The layout of the monomial vector a call adds to a Meter, by name.

    ``monomials``: those of the polynomials, every symbol among them (so a Meter also sums sizes:
    tokens, images); then, for a mixture-of-experts program, measured columns filled in by routing
    probes (``fxflops/routing.py``) after a call ran: ``routed`` (each expert module's measured
    forward FLOPs), ``calls`` and ``measured_calls`` (calls whose routing was measured).
    """

    def __init__(self, monomials: Iterable[sympy.Expr], experts: int) -> None:
        self.monomials = tuple(sorted(set(monomials), key=sympy.default_sort_key))
        self.routed = tuple(sympy.Symbol(f"routed_{i}") for i in range(experts))
        self.bookkeeping = (_CALLS, _MEASURED) if experts else ()
        self.columns: tuple[sympy.Expr, ...] = self.monomials + self.routed + self.bookkeeping
        self.index = {m: i for i, m in enumerate(self.columns)}

    def __len__(self) -> int:
        return len(self.columns)

    def column(self, name: str) -> int | None:
        """The column of the monomial printed as ``name`` (a symbol: ``"tokens"``), else None."""
        return next((i for i, m in enumerate(self.columns) if str(m) == name), None)

    def measured_defaults(self) -> list[str]:
        """What a call's generated monomials put in the measured columns before probes fill them:
        nothing routed, one call, not measured."""
        return ["0"] * len(self.routed) + (["1", "0"] if self.bookkeeping else [])

    def with_measured(self, monomials: tuple, routed: Sequence[Any], complete: bool) -> tuple:
        """``monomials`` with the routed columns set and the call counted as measured if ``complete``."""
        return (*monomials[: len(self.monomials)], *routed, 1, int(complete))

    def calls(self, sums: Sequence[Any]) -> tuple[int, int]:
        """(calls, calls whose routing was measured) in accumulated monomials of an MoE program."""
        return sums[self.index[_CALLS]], sums[self.index[_MEASURED]]


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
        analysis: Analysis,
        binder: Binder,
        symbols: Iterable[sympy.Symbol],
        guards: list[Guard],
        module_paths: Iterable[str] = (),
        *,
        backward: str = "none",
        prepare: Callable[[tuple, dict], tuple[tuple, dict]] = _identity,
        state: ModelState | None = None,
        derived: dict[str, DerivedSize] | None = None,
        symbolic_arguments: frozenset[str] = frozenset(),
    ) -> None:
        if backward not in BACKWARD_RULES:
            raise ValueError(f"backward must be one of {BACKWARD_RULES}, not {backward!r}")
        self.terms = analysis.terms
        self.unsupported = analysis.unsupported
        self.notes = analysis.notes
        self.families = analysis.families
        self.derived = derived or {}  # symbol name -> the size it is, computed from metadata values (capture/derived.py)
        self.experts = analysis.experts  # MoE expert modules (``analysis/moe.py``)
        self.reused = analysis.reused  # layers billed as repeats of a traced layer (capture/reuse.py)
        self.measured: dict[str, str] = {}  # module -> why its own code is measured per call (fxflops/islands.py)
        self.backward = backward
        # ``backward="2x"`` (twice each forward term) is the convention of formula-based tools
        self.convention = FLOPCOUNTER.but(backward="2x") if backward == "2x" else FLOPCOUNTER
        self.all_symbols = tuple(sorted(symbols, key=str))  # what the binder reads, in order
        self.guards = guards
        self.binder = binder
        self.prepare = prepare  # the model family's adapter: the call the model runs (``fxflops/adapters``)
        self.situation: tuple | None = None  # (call key, mode key) of the traced call (fxflops/situation.py)
        self.call_keys = CallKeys(binder._forward, symbolic_arguments)  # those arguments' ints are symbols
        self.state = state  # the model state it was traced in
        self.tree = nx.DiGraph()
        self.tree.add_node("")
        for path in [*module_paths, *(t.module for t in self.terms)]:
            nx.add_path(self.tree, ancestors(path))
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
        prepare: Callable[[tuple, dict], tuple[tuple, dict]] = _identity,
    ) -> Program:
        """Rules applied to a capture (``fxflops/analysis/``), compiled. ``segments`` names segment
        families by input label (``{"cu_seqlens": "text"}``); ``strict_metadata`` also validates
        device metadata (a sync); ``backward`` says where backward terms come from: ``"traced"`` (the
        capture's own backward graph), ``"2x"`` (twice each forward term: the program's default
        convention becomes FLOPCOUNTER with ``backward="2x"``) or ``"none"``; ``prepare`` is the
        model family's adapter's."""
        if backward not in BACKWARD_RULES:
            raise ValueError(f"backward must be one of {BACKWARD_RULES}, not {backward!r}")
        analysis = analyze(captured, segments)
        # device metadata is checked on the device: a flag per family, and VALID, 0 for a malformed call
        flags = (*analysis.flags.values(), *((VALID,) if analysis.flags else ()))
        symbols = tuple(sorted([*captured.symbols.values(), *analysis.power_sums, *analysis.kept_pairs, *flags], key=str))
        forward = model.forward if isinstance(model, torch.nn.Module) else model
        # row sums: a segment family's first power sums; counts: the size's own count() (capture/derived.py)
        derived = {sym: size for sym, size in captured.derived.items() if sym in symbols}
        sums = {sym: (derived_family(size), 1) for sym, size in derived.items() if isinstance(size, RowSum)}
        counts = {sym: size for sym, size in derived.items() if isinstance(size, CountedSize)}
        binder = Binder(
            forward, captured.input_dims, symbols, {**analysis.power_sums, **sums}, strict_metadata, analysis.flags,
            analysis.kept_pairs, counts,
        )
        modules = isinstance(model, torch.nn.Module)
        # the model state the trace depended on (fxflops/situation.py)
        state = ModelState(model, captured.reads, captured.copies, captured.grad, captured.constants()) if modules else None
        paths = (n for n, _ in model.named_modules()) if modules else ()
        return cls(
            analysis, binder, symbols, captured.guards, paths, backward=backward, prepare=prepare, state=state,
            derived={str(sym): size for sym, size in derived.items()}, symbolic_arguments=captured.symbolic_arguments,
        )

    # ---- compilation to the monomial basis -------------------------------------------------
    def _formulas(self, convention: Convention) -> dict[tuple[str, str], sympy.Expr]:
        """Inclusive formula per (module, phase) under ``convention`` (cached)."""
        if convention.count == "all":
            refuse_every_op_count(self.derived)  # a stand-in that leaves such work out (capture/derived.py)
        if convention not in self._formula_cache:
            formulas: dict[tuple[str, str], sympy.Expr] = defaultdict(lambda: sympy.Integer(0))
            for module, phase, flops in convention_terms(self.terms, self.experts, self.layout.routed, convention):
                for path in ancestors(module):
                    formulas[(path, phase)] += flops
            self._formula_cache[convention] = {key: sympy.expand(expr) for key, expr in formulas.items()}
        return self._formula_cache[convention]

    def _rows(self, convention: Convention) -> tuple[dict[tuple[str, str], list[tuple[int, int]]], int]:
        """Integer coefficient rows over ``self.basis`` per (module, phase), and their common
        denominator, under ``convention`` (cached)."""
        if convention not in self._row_cache:
            coefficient_maps = {key: expr.as_coefficients_dict() for key, expr in self._formulas(convention).items()}
            column = self.layout.index
            denominator = math.lcm(1, *(sympy.fraction(c)[1] for cm in coefficient_maps.values() for c in cm.values()))
            rows = {key: [(column[m], int(c * denominator)) for m, c in cm.items()] for key, cm in coefficient_maps.items()}
            self._row_cache[convention] = (rows, denominator)
        return self._row_cache[convention]

    def _compile(self) -> None:
        """The monomial basis of every convention's polynomials and the generated evaluators."""
        self._formula_cache: dict[Convention, dict[tuple[str, str], sympy.Expr]] = {}
        self._row_cache: dict[Convention, tuple[dict, int]] = {}
        variants = [t.flops for t in self.terms] + [t.causal_exact for t in self.terms if t.causal_exact is not None]
        monomials = {m for v in variants for m in sympy.expand(v).as_coefficients_dict()}
        self.layout = Basis(monomials | set(self.all_symbols) | ({OUTSIDE} if self.derived else set()), len(self.experts))
        self._generate()

    @property
    def basis(self) -> tuple[sympy.Expr, ...]:
        """The monomial vector's columns (:class:`Basis`)."""
        return self.layout.columns

    def _generate(self) -> None:
        """``monomials(*values)`` and ``within_guards(*values)``: generated Python over the binder's
        symbol order (rebuilt after a copy or a load: generated code is not pickled)."""
        names = {sym: f"v{i}" for i, sym in enumerate(self.all_symbols)}
        params = ", ".join(names.values())
        # a call whose device metadata is malformed adds nothing but its malformed flags (Meter.report)
        # and one outside the deferred guards on its device-derived sizes, only its OUTSIDE column (guards.py)
        flags = set(self.binder.flags.values()) | {VALID, OUTSIDE}
        valid = (f" * {names[VALID]}" if VALID in names else "") + (" * _held" if OUTSIDE in self.layout.index else "")
        regular = [python_source(m, {**names, OUTSIDE: "(1 - _held)"}) + ("" if m in flags else valid) for m in self.layout.monomials]
        monomials = ", ".join(regular + self.layout.measured_defaults())
        minimums = {sym: self.derived[str(sym)].minimum for sym in self.all_symbols if str(sym) in self.derived}
        checks, held, needed = guard_checks(self.guards, self.all_symbols, names, minimums, OUTSIDE in self.layout.index)
        scope = generated(
            f"def monomials({params}):\n" + "".join(f"{line}\n" for line in held)
            + f"    return ({monomials}{',' if self.basis else ''})\n"
            f"def within_guards({params}):\n    return {checks}\n",
            "program",
            **needed,
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
        state.setdefault("derived", {})  # a program saved before derived sizes existed
        self.__dict__.update(state)
        self._generate()

    def with_routing(self, monomials: tuple, measured: dict[str, Any]) -> tuple:
        """One call's monomials with the forward FLOPs its expert modules measured (``fxflops/routing.py``)
        in the ``routed_i`` columns; the call counts as measured when every expert module was."""
        if not self.experts:
            return monomials
        complete = all(path in measured for path in self.experts)
        return self.layout.with_measured(monomials, [measured.get(path, 0) for path in self.experts], complete)

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
        convention: Convention | str | None = None,
    ) -> int:
        """``C[module, phase] · m`` for accumulated monomials ``m`` (all phases when ``phase`` is None;
        a tuple sums several) under ``convention`` (default: the program's; a preset by name too)."""
        convention = as_convention(convention) or self.convention
        if convention.moe == "actual" and self.experts:
            calls, measured = self.layout.calls(monomial_sums)
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
        column = self.layout.index
        found = {str(flag)[len("malformed_"):]: _exact_int(monomial_sums[column[flag]]) for flag in self.binder.flags.values()}
        found[OUTSIDE_KEY] = _exact_int(monomial_sums[column[OUTSIDE]]) if OUTSIDE in column else 0
        return {name: n for name, n in found.items() if n}

    def total(self, phase: str | None = None, convention: Convention | str | None = None, **values: int) -> int:
        """Total FLOPs at these symbol values, e.g. ``program.total(seq=2048)``."""
        return self.evaluate(self.monomials(*self.values_of(as_convention(convention), **values)), "", checked_phase(phase), convention)

    def breakdown(
        self, depth: int | None = None, phase: str | None = None, convention: Convention | str | None = None, **values: int
    ) -> dict[str, int]:
        """Inclusive FLOPs of every module (``depth``: only paths at most that deep; root depth 0)."""
        m = self.monomials(*self.values_of(as_convention(convention), **values))
        return {path: self.evaluate(m, path, checked_phase(phase), convention) for path in self.modules(depth)}

    def modules(self, depth: int | None = None) -> list[str]:
        """Module paths in tree order (pre-order from the root), optionally cut at ``depth``."""
        order = list(nx.dfs_preorder_nodes(self.tree, ""))
        return [p for p in order if depth is None or path_depth(p) <= depth]

    def formula(self, path: str = "", phase: str | None = None, convention: Convention | str | None = None) -> sympy.Expr:
        """Closed form of a module's inclusive FLOPs in the named symbols under ``convention``."""
        if path not in self.tree:  # a misspelt path would read as a module without FLOPs: refused
            raise ValueError(f"no module {path!r} in the program; its top modules: {self.modules(1)}")
        formulas, phases = self._formulas(as_convention(convention) or self.convention), PHASES if checked_phase(phase) is None else (phase,)
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
        if malformed.pop(OUTSIDE_KEY, 0):  # a guard on sizes derived on a device (fxflops/guards.py): read them
            raise GuardError(self.explain_guard_failure(tuple(_exact_int(v) if isinstance(v, torch.Tensor) else v for v in values)))
        if malformed:
            raise MetadataError(f"malformed segment metadata {sorted(malformed)} (offsets not from 0, decreasing, or past the packed length)")
        return self.evaluate(monomials)

    @property
    def power_sums(self) -> dict[str, tuple[str, int]]:
        """Each segment power-sum symbol's name -> (its family's name, k): the symbol is pₖ = Σᵢ sᵢᵏ
        of that family's segment lengths (the binder computes it from the offsets or grid)."""
        return {str(sym): (family.name, k) for sym, (family, k) in self.binder.stats.items() if str(sym) not in self.derived}

    @property
    def relations(self) -> list[sympy.Basic]:
        """What every call satisfies between the symbols, from the capture: a family's p₁ equals the
        packed size its segments cover (``Eq``) or is at most the one they cut; for lengths ≥ 1,
        p₁ ≤ p₂ ≤ p₁²; p₀ of offsets is their length − 1. ``fxflops.verify`` simplifies under them."""
        found: list[sympy.Basic] = []
        have = set(self.all_symbols)
        for family in self.families:
            p0, p1, p2 = (family.power_sum(k) for k in range(3))
            if p1 in have:
                found += [sympy.Eq(p1, size) for size in sorted(family.covered, key=str) if size != p1]
                found += [sympy.Le(p1, size) for size in sorted(family.packed - family.covered, key=str) if size != p1]
            if {p1, p2} <= have:
                found += [sympy.Le(p1, p2), sympy.Le(p2, p1**2)]
            rows = self.binder.dim_exprs.get(family.source)
            if p0 in have and family.lengths.values.diff and rows:
                found.append(sympy.Eq(p0, rows[0] - 1))
        return found

    def describe_symbols(self) -> dict[str, str]:
        """What each symbol means: an input dimension, a segment power sum or a mask's kept pairs."""
        meaning = {}
        for path, exprs in self.binder.dim_exprs.items():
            for d, expr in enumerate(exprs):
                if isinstance(expr, sympy.Symbol) and str(expr) not in meaning:
                    meaning[str(expr)] = f"dim {d} of input {path_label(path)}"
        families = {family.name: family for family in self.families}
        for name, (family, k) in self.power_sums.items():
            meaning[name] = f"Σᵢ sᵢ^{k} over {families[family].describe()}"
        for name, size in self.derived.items():
            meaning[name] = size.describe()
        for sym, pairs in self.binder.kept_pairs.items():
            window = "" if pairs.window is None else f" with a sliding window of {pairs.window} keys"
            padding = "" if pairs.padding is None else f" for non-zero {path_label(pairs.padding)}"
            runs = "" if pairs.runs is None else f" inside the runs of consecutive {path_label(pairs.runs)} (packed sequences)"
            kind = "a block-diagonal attention mask" if pairs.offset is None else f"a causal attention mask{window}"
            meaning[str(sym)] = f"(batch, query, key) triples {kind} keeps{padding}{runs}"
        return {str(s): meaning.get(str(s), "") for s in self.symbols}

    # ---- reporting -----------------------------------------------------------------------------
    def to_json(self) -> str:
        """Symbols, guards, per-module formulas, terms and unsupported ops as a JSON document."""
        from fxflops.report import program_json

        return program_json(self)

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
