"""Meter: accumulates counted calls as monomial sums, reads totals and breakdowns on demand.

Each program (one per capture branch) has its own monomial basis; a call adds its monomial vector to
that program's accumulator (a few integer additions, whatever the number of modules). Entries that
come from device metadata (segment power sums) are 0-d tensors and accumulate on their device; they
are copied to the host once per read. Totals and breakdowns are ``C · Σm`` at read time, in exact
Python integers (no overflow at 10²¹ FLOPs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fxflops.program import Program


class Meter:
    """FLOPs accumulated over calls: ``total(phase=None)``, ``breakdown(depth, phase)``, ``reset()``.

    A call is added either as a training call (every phase its program has: forward, backward,
    recompute) or as a forward-only call (an inference forward: only ``fwd`` counts).
    """

    def __init__(self) -> None:
        self._sums: dict[tuple[int, bool], tuple[Program, list[int], bool]] = {}
        self.calls = 0
        self.uncounted = 0

    def add(self, program: Program, monomials: tuple[int, ...], training: bool = True) -> None:
        """Add one call's monomial vector for ``program`` (``training=False``: forward only)."""
        entry = self._sums.get((id(program), training))
        if entry is None:
            self._sums[(id(program), training)] = (program, list(monomials), training)
        else:
            acc = entry[1]
            for i, m in enumerate(monomials):
                acc[i] += m
        self.calls += 1

    def _on_host(self) -> list[tuple[Program, list[int], bool]]:
        """Each accumulator as Python ints (one device-to-host copy per device)."""
        return [(program, _to_host(acc), training) for program, acc, training in self._sums.values()]

    @staticmethod
    def _phase(phase: str | None, training: bool) -> str | tuple[str, ...] | None:
        """The phases a kind of call contributes to a query for ``phase``."""
        if training:
            return phase
        return ("fwd",) if phase in (None, "fwd") else ()

    def total(self, phase: str | None = None) -> int:
        """FLOPs of every counted call since the last reset (all phases unless ``phase``)."""
        return sum(
            program.evaluate(acc, "", self._phase(phase, training)) for program, acc, training in self._on_host()
        )

    def breakdown(self, depth: int | None = None, phase: str | None = None) -> dict[str, int]:
        """Inclusive FLOPs per module path accumulated since the last reset."""
        out: dict[str, int] = {}
        for program, acc, training in self._on_host():
            for path in program.modules(depth):
                out[path] = out.get(path, 0) + program.evaluate(acc, path, self._phase(phase, training))
        return out

    def reset(self) -> None:
        """Forget every accumulated call."""
        self._sums.clear()
        self.calls = 0
        self.uncounted = 0

    def table(self, depth: int | None = None) -> str:
        """The accumulated breakdown as a readable table."""
        from fxflops.report import meter_table

        return meter_table(self.breakdown(depth))


def _to_host(values: list[Any]) -> list[int]:
    """Python ints for a list mixing ints and 0-d integer tensors (stacked: one copy per device)."""
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if not on_device:
        return values
    host = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i in on_device:
        by_device.setdefault(values[i].device, []).append(i)
    for indices in by_device.values():
        for i, v in zip(indices, torch.stack([values[i].long() for i in indices]).tolist()):
            host[i] = v
    return host
