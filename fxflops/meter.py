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
    from fxflops.conventions import Convention
    from fxflops.program import Program


class Meter:
    """FLOPs accumulated over calls: ``total(phase=None)``, ``breakdown(depth, phase)``, ``reset()``.

    A call is added either as a training call (every phase its program has: forward, backward,
    recompute) or as a forward-only call (an inference forward: only ``fwd`` counts).
    """

    def __init__(self) -> None:
        self._sums: dict[tuple[int, bool, str], tuple[Program, list[int], bool, str]] = {}
        self.calls = 0
        self.uncounted = 0

    def add(self, program: Program, monomials: tuple[int, ...], training: bool = True, prefix: str = "") -> None:
        """Add one call's monomial vector for ``program`` (``training=False``: forward only).
        ``prefix`` is the module path the program's root ran at (a compiled graph of a submodule)."""
        key = (id(program), training, prefix)
        entry = self._sums.get(key)
        if entry is None:
            self._sums[key] = (program, list(monomials), training, prefix)
        else:
            acc = entry[1]
            for i, m in enumerate(monomials):
                acc[i] += m
        self.calls += 1

    def _on_host(self) -> list[tuple[Program, list[int], bool, str]]:
        """Each accumulator as Python ints (one device-to-host copy per device)."""
        return [(program, _to_host(acc), training, prefix) for program, acc, training, prefix in self._sums.values()]

    @staticmethod
    def _phase(phase: str | None, training: bool) -> str | tuple[str, ...] | None:
        """The phases a kind of call contributes to a query for ``phase``."""
        if training:
            return phase
        return ("fwd",) if phase in (None, "fwd") else ()

    def total(self, phase: str | None = None, convention: Convention | None = None) -> int:
        """FLOPs of every counted call since the last reset (all phases unless ``phase``), under
        ``convention`` (default: each program's own)."""
        return sum(
            program.evaluate(acc, "", self._phase(phase, training), convention)
            for program, acc, training, _ in self._on_host()
        )

    def model_flops(self, convention: Convention | None = None) -> int:
        """Forward + backward: the numerator of MFU (recomputation is not useful work)."""
        return self.total("fwd", convention) + self.total("bwd", convention)

    def hardware_flops(self, convention: Convention | None = None) -> int:
        """Forward + backward + activation-checkpointing recompute: the numerator of HFU."""
        return self.total(None, convention)

    def breakdown(
        self, depth: int | None = None, phase: str | None = None, convention: Convention | None = None
    ) -> dict[str, int]:
        """Inclusive FLOPs per module path accumulated since the last reset."""
        out: dict[str, int] = {}
        for program, acc, training, prefix in self._on_host():
            phases = self._phase(phase, training)
            for path in program.modules(None if depth is None else depth - _depth(prefix)):
                full = ".".join(p for p in (prefix, path) if p)
                out[full] = out.get(full, 0) + program.evaluate(acc, path, phases, convention)
            parts = prefix.split(".") if prefix else []
            for ancestor in ["", *(".".join(parts[: i + 1]) for i in range(len(parts) - 1))]:
                if prefix and (depth is None or _depth(ancestor) <= depth):  # roll a submodule's graph up
                    out[ancestor] = out.get(ancestor, 0) + program.evaluate(acc, "", phases, convention)
        return out

    def reset(self) -> None:
        """Forget every accumulated call."""
        self._sums.clear()
        self.calls = 0
        self.uncounted = 0

    def table(self, depth: int | None = None, convention: Convention | None = None) -> str:
        """The accumulated breakdown as a readable table, headed by the convention it counts in."""
        from fxflops.conventions import FLOPCOUNTER
        from fxflops.report import meter_table

        named = convention or next((p.convention for p, *_ in self._sums.values()), FLOPCOUNTER)
        return f"convention {named.describe()}\n" + meter_table(self.breakdown(depth, convention=convention))


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


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
