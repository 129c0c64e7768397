"""What the analysis of a graph produces per node: a :class:`Term`, or an :class:`Unsupported` op."""

from __future__ import annotations

from dataclasses import dataclass

import sympy


@dataclass(frozen=True)
class Term:
    """The FLOPs of one graph node: ``flops`` (sympy) done by ``op`` inside module ``module``.

    ``kind`` is the rule's kind (``matmul``, ``elementwise``, ``embedding``: which conventions count
    it); ``causal_exact`` the exact count of a causal attention call (``flops`` is the dense count),
    or of the pairs its mask keeps; ``causal_half`` what ``causal="half"`` counts when that is not
    ``flops / 2`` (a sliding window: dense; packed sequences: half their blocks, Σᵢ sᵢ²/2).
    """

    node: str
    op: str
    module: str
    phase: str
    flops: sympy.Expr
    kind: str = "matmul"
    causal_exact: sympy.Expr | None = None
    router: bool = False  # a mixture-of-experts router GEMM (or its backward): see ``analysis/moe.py``
    dims: tuple[int, ...] = ()  # the static sizes of its tensor operands (> 1): what a formula may size differently
    causal_half: sympy.Expr | None = None


@dataclass(frozen=True)
class Unsupported:
    """A floating-point op with no rule: its work is unknown, so totals are lower bounds."""

    node: str
    op: str
    module: str

    def __str__(self) -> str:
        return f"{self.op} (graph node {self.node}) in module {self.module or '<root>'!r}"
