"""A program's guards as generated checks; those on derived sizes checked on the sizes' device (no
host sync).

A derived size (``capture/derived.py``: the real frames of ``pixel_values``, the patches
``image_sizes`` keeps, the image tokens of ``input_ids``) of an input on an accelerator is a 0-d
tensor on its device, and a program's guards that mention it (``image_frames >= 1``,
``image_patches <= images·⌊height/8⌋·⌊width/8⌋``) would be read on the host to choose the
program: one sync per call. :func:`split` sorts a program's guards:

* an ``Eq`` or ``Ne`` whose two sides differ by a factor of a derived size that is at least 1 (its
  own minimum guard) holds exactly when the rest of the difference does: ``Eq(32·R·X, 512·R)`` is
  ``Eq(32·X - 512, 0)``, a guard on shapes;
* a guard on shapes only is checked on the host, as every guard is for host metadata;
* ``Eq`` on a derived size (a trace that fixed it, ``Eq(image_patches, 1)``) chooses between
  programs: checked on the host (a sync, only for such programs);
* every other guard on a derived size is **deferred** when its value is a tensor: the program's
  ``within_guards`` passes it, its ``monomials`` are multiplied by the guard's truth as a 0-d
  tensor (computed with the call's other device sums) and the :data:`OUTSIDE` column counts the
  calls outside, which the Meter reports as uncounted (:data:`OUTSIDE_KEY`), as it does malformed
  device metadata. On the host the same call is re-captured or measured exactly instead. A guard
  whose printed Python is not plain arithmetic and comparisons (``math.trunc``, ``and``) stays on
  the host.

:func:`checks` writes them as the generated ``within_guards`` expression and the ``_held`` lines of
``monomials``; a guard the printer cannot write exactly is evaluated by substitution
(``binder.guard_evaluator``).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from fxflops.binder import guard_evaluator, python_source
from fxflops.capture.symbols import Guard

OUTSIDE = sympy.Symbol("outside_derived_guards", integer=True, nonnegative=True)
"""A program's column counting the calls whose device-derived sizes broke a deferred guard."""
OUTSIDE_KEY = "sizes derived on a device outside their program's guards"
"""The name under which a Meter reports those calls (with malformed device metadata)."""


def cancelled(expr: sympy.Basic, at_least_one: set[sympy.Symbol]) -> sympy.Basic:
    """``expr`` without the factors of its ``Eq``/``Ne`` difference that are (powers of) sizes in
    ``at_least_one``: a non-zero factor changes neither equality."""
    if not isinstance(expr, (sympy.Eq, sympy.Ne)):
        return expr
    coefficient, factors = sympy.factor_terms(expr.lhs - expr.rhs).as_coeff_mul()
    kept = [f for f in factors if f.as_base_exp()[0] not in at_least_one]
    if len(kept) == len(factors):
        return expr
    return type(expr)(sympy.Mul(coefficient, *kept), 0)


def split(guards: list[Guard], minimums: dict[sympy.Symbol, int]) -> tuple[list[Guard], list[Guard]]:
    """(guards checked on the host, guards deferred when their derived sizes are tensors) of a
    program whose derived sizes have ``minimums`` (see the module docstring)."""
    at_least_one = {sym for sym, least in minimums.items() if least >= 1}
    host: list[Guard] = []
    deferred: list[Guard] = []
    for guard in guards:
        expr = cancelled(guard.expr, at_least_one)
        on_derived = expr.free_symbols & set(minimums)
        if not on_derived or isinstance(expr, sympy.Eq) or not _tensor_safe(expr):
            host.append(Guard(expr, guard.location))
        else:
            deferred.append(Guard(expr, guard.location))
    return host, deferred


def _tensor_safe(expr: sympy.Basic) -> bool:
    """The printed Python of ``expr`` is arithmetic and comparisons only: it evaluates on 0-d tensors
    as on ints (no ``math.`` call, no ``and``/``or``/``not``, which would read a tensor's truth)."""
    printed = python_source(expr, {s: "v" for s in expr.free_symbols})
    return not any(word in printed for word in ("math.", "torch.", " and ", " or ", "not ", "True", "False"))


def checks(
    guards: list[Guard], symbols: tuple[sympy.Symbol, ...], names: dict[sympy.Symbol, str],
    minimums: dict[sympy.Symbol, int], deferring: bool,
) -> tuple[str, list[str], dict[str, Any]]:
    """(the ``within_guards`` expression, the ``monomials`` lines computing ``_held``, the names
    they need) over variables ``names`` of ``symbols``; guards on derived sizes (``minimums``)
    deferred where ``deferring`` (the program has the :data:`OUTSIDE` column)."""
    host, deferred = split(guards, minimums) if deferring else (guards, [])
    params = ", ".join(names[s] for s in symbols)
    exact = [guard_evaluator(g.expr, symbols) for g in host]
    written = [f"({python_source(g.expr, names)})" if e is None else f"_exact[{i}]({params})" for i, (g, e) in enumerate(zip(host, exact))]
    if not deferred:  # _held only where the monomials use it (a program with derived sizes)
        return " and ".join(written) or "True", ["    _held = 1"] if deferring else [], {"_exact": exact}
    factors: list[str] = []
    for guard in deferred:  # each on the host when its derived sizes are ints there, else a device flag
        on_device = " or ".join(f"isinstance({names[s]}, _Tensor)" for s in sorted(guard.expr.free_symbols & set(minimums), key=str))
        printed = f"({python_source(guard.expr, names)})"
        written.append(f"({on_device} or {printed})")
        factors.append(f"({printed} if {on_device} else 1)")
    return " and ".join(written), [f"    _held = 1 * {' * '.join(factors)}"], {"_exact": exact, "_Tensor": torch.Tensor}
