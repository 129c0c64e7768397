"""Helpers for tests that check hand formulas: ``assert_formula`` for pytest."""

from __future__ import annotations

from typing import Any

from fxflops.verify import Verdict, verify


def assert_formula(program: Any, formula: Any, **options: Any) -> Verdict:
    """Assert that ``formula`` equals the program's FLOPs (options as for :func:`fxflops.verify`);
    the assertion message is the verdict's report, with the difference attributed to modules."""
    verdict = verify(program, formula, **options)
    if not verdict.equal:
        raise AssertionError(str(verdict))
    return verdict
