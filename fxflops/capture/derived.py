"""Derived sizes: a size the model computes from the *values* of an input, which no input shape
carries, made a symbol of the capture.

A Pixtral vision tower keeps, of each padded image i, the ⌊hᵢ/p⌋ × ⌊wᵢ/p⌋ patches its
``image_sizes`` row describes, and runs its transformer on all of them as one sequence: the
transformer's work is a polynomial in N = Σᵢ ⌊hᵢ/p⌋·⌊wᵢ/p⌋, a sum over the rows of ``image_sizes``
of an expression in the row's columns (:class:`RowSum`). An Idefics3 / SmolVLM model drops the
padding frames of its ``pixel_values`` (frames all zero) and runs its vision tower on the R real
ones: a count of the rows of ``pixel_values`` that are not all zero (:class:`NonZeroRows`). A
Phi-4-multimodal model projects as many rows of image features as ``input_ids`` holds image tokens
(:class:`TokenCount`).

The family's adapter declares such a size (``Adapter.derived_sizes``), the capture creates a symbol
for it with the example call's value as its hint (``capture/symbols.py``), the adapter's
capture-time stand-ins size the tensors with it, and the binder computes it from the input per call:
a :class:`RowSum` as a segment family's first power sum (``analysis/segments.py``, ``binder.py``),
a :class:`CountedSize` with its own :meth:`CountedSize.count`; on the host for a CPU input, with
tensor ops on its device otherwise (no host sync).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import sympy
import torch

from fxflops.capture.inputs import Path, path_label
from fxflops.errors import MetadataError


def column(j: int) -> sympy.Symbol:
    """Column ``j`` of a row of a 2-D metadata input."""
    return sympy.Symbol(f"c{j}", integer=True)


@dataclass(frozen=True)
class DerivedSize(abc.ABC):
    """A size named ``name``, computed from the values of the input at ``source``; a program
    captured with it holds for calls where it is at least ``minimum`` (what the adapter's
    stand-ins handle: a guard of the program). ``leaves_out``: the work, counted only under
    ``count="all"``, that the stand-ins sized by it do not trace (empty: none), for which a program
    with it refuses that count."""

    name: str
    source: Path
    leaves_out: str = field(default="", kw_only=True)

    @property
    def minimum(self) -> int:
        return 0

    @abc.abstractmethod
    def value(self, tensor: torch.Tensor) -> int:
        """The size for one call's input (read on the host: at capture, and for CPU inputs)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """In words, for ``program.describe_symbols()``."""


@dataclass(frozen=True)
class RowSum(DerivedSize):
    """``name`` = Σ over the rows of the 2-D integer input at ``source`` of ``per_row`` (an
    expression in :func:`column` symbols)."""

    per_row: sympy.Expr

    def value(self, metadata: torch.Tensor) -> int:
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
        label = path_label(self.source)
        columns = {column(j): sympy.Symbol(f"{label}[i, {j}]") for j in range(8)}
        return f"the sum over the rows i of {label} of {self.per_row.xreplace(columns)}"


@dataclass(frozen=True)
class CountedSize(DerivedSize):
    """A size counted from the input's values by tensor ops (:meth:`count`), which the binder calls
    per call; programs hold for calls with at least ``least`` of it."""

    least: int = 0

    @abc.abstractmethod
    def count(self, tensor: torch.Tensor, host: bool) -> int | torch.Tensor:
        """The size as an int on the host for a CPU input (when ``host``); else a 0-d tensor on the
        input's device (no host sync)."""

    @property
    def minimum(self) -> int:
        return self.least

    def value(self, tensor: torch.Tensor) -> int:
        return int(self.count(tensor, host=True))


@dataclass(frozen=True)
class NonZeroRows(CountedSize):
    """``name`` = the rows of the input at ``source`` (its first ``lead`` dims flattened: one row per
    frame of a (batch, frames, C, H, W) input) holding any non-zero value."""

    lead: int = 2

    def count(self, tensor: torch.Tensor, host: bool) -> int | torch.Tensor:
        if tensor.dim() <= self.lead:
            raise MetadataError(f"{path_label(self.source)} needs more than {self.lead} dims to derive {self.name}, not {tensor.dim()}")
        # any() is true for a row with a non-zero (or NaN) value: the model's "not all == 0"
        rows = torch.count_nonzero(tensor.reshape(math.prod(tensor.shape[: self.lead]), math.prod(tensor.shape[self.lead :])).any(1))
        return int(rows) if host and tensor.is_cpu else rows

    def describe(self) -> str:
        return f"the rows of {path_label(self.source)} (its first {self.lead} dims flattened) not all zero"


@dataclass(frozen=True)
class TokenCount(CountedSize):
    """``name`` = the elements of the integer input at ``source`` equal to ``token`` (the image
    tokens of ``input_ids``: the rows a model writes its image features to)."""

    token: int = 0

    def count(self, tensor: torch.Tensor, host: bool) -> int | torch.Tensor:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            raise MetadataError(f"{path_label(self.source)} must be an integer tensor to derive {self.name}, not {tensor.dtype}")
        tokens = torch.count_nonzero(tensor == self.token)
        return int(tokens) if host and tensor.is_cpu else tokens

    def describe(self) -> str:
        return f"the elements of {path_label(self.source)} equal to {self.token}"


def refuse_every_op_count(derived: dict[str, DerivedSize]) -> None:
    """Raise ValueError when a stand-in sized by one of ``derived`` (by symbol name) leaves out work
    that ``count="all"`` counts (:attr:`DerivedSize.leaves_out`): that count would not be exact."""
    left = {name: getattr(size, "leaves_out", "") for name, size in derived.items()}  # older pickles lack it
    if any(left.values()):
        raise ValueError(
            "count='all' is not exact for this program: its adapter's stand-ins leave out "
            + "; ".join(f"{what} (derived size {name})" for name, what in sorted(left.items()) if what)
            + ", work only count='all' counts; every count='matmul' convention (MFU) is exact"
        )


class TracedSize(NamedTuple):
    """A derived size in the trace: its SymInt, and the fake tensor of the input it is derived from
    (a stand-in checks that the metadata it receives is that input)."""

    symint: torch.SymInt
    source: torch.Tensor
