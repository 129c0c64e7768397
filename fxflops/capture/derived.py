"""Derived sizes: a size the model computes from the *values* of a metadata input, which no input
shape carries, made a symbol of the capture.

A Pixtral vision tower keeps, of each padded image i, the ⌊hᵢ/p⌋ × ⌊wᵢ/p⌋ patches its
``image_sizes`` row describes, and runs its transformer on all of them as one sequence: the
transformer's work is a polynomial in N = Σᵢ ⌊hᵢ/p⌋·⌊wᵢ/p⌋, a sum over the rows of ``image_sizes``
of an expression in the row's columns. Such a size is a :class:`DerivedSize`: the family's adapter
declares it (``Adapter.derived_sizes``), the capture creates a symbol for it with the example call's
value as its hint (``capture/symbols.py``), the adapter's capture-time stand-ins size the tensors with
it, and the binder computes it from the input per call as it computes a segment family's first
power sum (p₁ = Σ over rows of an expression in the row's columns: ``analysis/segments.py`` and
``binder.py``), on the host for a CPU input, with tensor ops on its device otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import sympy
import torch

from fxflops.capture.inputs import Path, path_label
from fxflops.errors import MetadataError


def column(j: int) -> sympy.Symbol:
    """Column ``j`` of a row of a 2-D metadata input."""
    return sympy.Symbol(f"c{j}", integer=True)


@dataclass(frozen=True)
class DerivedSize:
    """``name`` = Σ over the rows of the input at ``source`` of ``per_row`` (in :func:`column` symbols)."""

    name: str
    source: Path
    per_row: sympy.Expr

    def value(self, metadata: torch.Tensor) -> int:
        """The size for one call's ``metadata`` (a 2-D integer tensor; read on the host)."""
        if metadata.dim() != 2 or metadata.dtype.is_floating_point or metadata.dtype.is_complex:
            raise MetadataError(f"{path_label(self.source)} must be a 2-D integer tensor to derive {self.name}")
        total = 0
        for row in metadata.tolist():
            term = self.per_row.xreplace({column(j): sympy.Integer(v) for j, v in enumerate(row)})
            if not term.is_Integer or term < 0:
                raise MetadataError(f"row {row} of {path_label(self.source)} gives {self.name} {term} ({self.per_row}): not a size")
            total += int(term)
        return total

    def describe(self) -> str:
        """In words, for ``program.describe_symbols()``."""
        label = path_label(self.source)
        columns = {column(j): sympy.Symbol(f"{label}[i, {j}]") for j in range(8)}
        return f"the sum over the rows i of {label} of {self.per_row.xreplace(columns)}"


class TracedSize(NamedTuple):
    """A derived size in the trace: its SymInt, and the fake tensor of the input it is derived from
    (a stand-in checks that the metadata it receives is that input)."""

    symint: torch.SymInt
    source: torch.Tensor
