"""Meter: accumulates counted calls as monomial sums, reads totals, breakdowns and reports on demand.

Each program (one per capture branch) has its own monomial basis; a call adds its monomial vector to
that program's accumulator (a few integer additions, whatever the number of modules). Entries that
come from device metadata (segment power sums) are 0-d tensors and accumulate on their device; they
are copied to the host once per read. Totals and breakdowns are ``C · Σm`` at read time, in exact
Python integers (no overflow at 10²¹ FLOPs).

Generation (``Instrumented.generate``) adds its forwards as phases of their own: ``prefill`` (the
prompt's forward) and ``decode`` (each step after it), beside ``fwd``, ``bwd`` and ``recompute``.

For training: microbatches (gradient accumulation included) add up, ``meter.step()`` closes an
optimizer step, and ``meter.report()`` turns everything since the last report into a :class:`Report`
— FLOPs per step by phase, TFLOP/s per GPU, MFU and HFU against the device's peak, per-module TFLOP/s
and shares, tokens and images per second — summed over a ``torch.distributed`` group with one
collective, then starts over.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fxflops.analysis.counted import checked_phase
from fxflops.analysis.paths import ancestors, depth as path_depth, join
from fxflops.conventions import as_convention
from fxflops.errors import warn
from fxflops.guards import OUTSIDE_KEY
from fxflops.situation import STRUCTURE

_FOLD_EVERY = 256  # pending calls per accumulator before they are summed (reads fold them too)
TRAINING = "training"  # the kind of a call that adds every phase its program has
BACKWARD = "backward"  # the kind of a backward that ran from a call's outputs: its program's bwd and recompute
FORWARD_KINDS = ("fwd", "prefill", "decode")  # kinds of forward-only calls, each counted as its own phase
RECOMPUTED = "recompute"  # the kind of a forward that checkpoint() around a wrapper re-ran in a backward
PHASES = ("fwd", "bwd", "recompute", "prefill", "decode")
_AGAIN = (BACKWARD, RECOMPUTED)  # kinds of entries for calls counted by another entry (their sizes and metadata once)

if TYPE_CHECKING:
    from fxflops.conventions import Convention
    from fxflops.program import Program


class Meter:
    """FLOPs accumulated over calls: ``total(phase=None)``, ``breakdown(depth, phase)``, ``reset()``.

    A call is added either as a training call (every phase its program has: forward, backward,
    recompute) or as a forward-only call, whose forward counts as its kind's phase: ``fwd`` (an
    inference forward), ``prefill`` or ``decode`` (generation).
    """

    def __init__(self) -> None:
        self._sums: dict[tuple[int, str, str], tuple[Program, list[int], str, str]] = {}
        self._pending: dict[tuple[int, str, str], list[tuple]] = {}  # calls not yet folded into _sums
        self.calls = 0
        self.generated_tokens = 0
        self.uncounted = 0
        self.steps = 0
        self._started = time.perf_counter()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        with self._lock:  # the calls not yet folded are part of the copy
            for key in self._pending:
                self._fold(key)
            state = dict(self.__dict__)
            state["_sums"] = {key: (program, list(acc), kind, prefix) for key, (program, acc, kind, prefix) in self._sums.items()}
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        # accumulators are keyed by the identity of their (loaded) programs
        self._sums = {(id(entry[0]), *key[1:]): entry for key, entry in self._sums.items()}
        self._pending = {key: [] for key in self._sums}

    def not_counted(self) -> None:
        """One call that could not be counted."""
        with self._lock:
            self.uncounted += 1

    def add(
        self, program: Program, monomials: tuple[int, ...], training: bool = True, prefix: str = "", phase: str = "fwd",
        call: bool = True, backward: bool = False,
    ) -> None:
        """Add one call's monomial vector for ``program`` (``training=False``: forward only, counted
        as ``phase``: one of :data:`FORWARD_KINDS`, or :data:`RECOMPUTED`: a call's forward again, as
        the ``recompute`` phase). ``prefix`` is the module path the program's root
        ran at (a compiled graph of a submodule). ``call=False``: a part of a call counted already
        (a measured call's modules and its backward, ``fxflops/islands.py``). ``backward``: the
        backward of a call whose forward was added (its program's backward and recompute phases),
        added when that backward ran."""
        if phase not in FORWARD_KINDS and phase != RECOMPUTED:
            raise ValueError(f"phase must be one of {(*FORWARD_KINDS, RECOMPUTED)}, not {phase!r}")
        kind = BACKWARD if backward else TRAINING if training else phase
        key = (id(program), kind, prefix)
        with self._lock:  # calls from several threads add up exactly
            pending = self._pending.get(key)
            if pending is None:
                self._sums[key] = (program, list(monomials), kind, prefix)
                self._pending[key] = []
            else:
                pending.append(monomials)  # folded by columns, see _fold
                if len(pending) >= _FOLD_EVERY:
                    self._fold(key)
            self.calls += call

    def _fold(self, key: tuple) -> None:
        """Add the pending calls of ``key`` to its sums, column by column (under the lock)."""
        pending = self._pending[key]
        if pending:
            acc = self._sums[key][1]
            acc[:] = [a + sum(column) for a, column in zip(acc, zip(*pending))]
            pending.clear()

    def _on_host(self) -> list[tuple[Program, list[int], str, str]]:
        """Each accumulator as Python ints (one device-to-host copy per device)."""
        return self._snapshot().hosted

    def _snapshot(self, take: bool = False) -> _Snapshot:
        """The accumulators and counters at one instant (under the lock: a call adding meanwhile is
        in it whole or not at all); with ``take``, the meter starts over at that instant, so each
        call lands in exactly one report while other threads keep counting."""
        with self._lock:
            for key in self._pending:
                self._fold(key)
            entries = [(program, list(acc), kind, prefix) for program, acc, kind, prefix in self._sums.values()]
            snapshot = _Snapshot([], self.calls, self.uncounted, self.steps, self.generated_tokens, self._started)
            if take:
                self._clear()
        snapshot.hosted = [(program, _to_host(acc), kind, prefix) for program, acc, kind, prefix in entries]
        return snapshot

    @staticmethod
    def _phase(phase: str | None, kind: str) -> str | tuple[str, ...] | None:
        """The program phases a kind of call contributes to a query for ``phase``."""
        if kind == TRAINING:
            return phase if phase not in FORWARD_KINDS[1:] else ()
        if kind == BACKWARD:
            return tuple(p for p in ("bwd", "recompute") if phase in (None, p))
        return ("fwd",) if phase in (None, kind) else ()

    def total(self, phase: str | None = None, convention: Convention | str | None = None, _hosted: list | None = None) -> int:
        """FLOPs of every counted call since the last reset (all phases unless ``phase``), under
        ``convention`` (default: each program's own; a preset by name too)."""
        checked_phase(phase, PHASES)
        return sum(
            program.evaluate(acc, "", self._phase(phase, kind), convention)
            for program, acc, kind, _ in (_hosted if _hosted is not None else self._on_host())
        )

    def model_flops(self, convention: Convention | None = None) -> int:
        """Every phase but recompute: the numerator of MFU (recomputation is not useful work)."""
        return self.total(None, convention) - self.total("recompute", convention)

    def hardware_flops(self, convention: Convention | None = None) -> int:
        """Every phase, activation-checkpointing recompute included: the numerator of HFU."""
        return self.total(None, convention)

    def breakdown(
        self,
        depth: int | None = None,
        phase: str | None = None,
        convention: Convention | None = None,
        _hosted: list | None = None,
    ) -> dict[str, int]:
        """Inclusive FLOPs per module path accumulated since the last reset."""
        checked_phase(phase, PHASES)
        out: dict[str, int] = {}
        for program, acc, kind, prefix in _hosted if _hosted is not None else self._on_host():
            phases = self._phase(phase, kind)
            for path in program.modules(None if depth is None else depth - path_depth(prefix)):
                full = join(prefix, path)
                out[full] = out.get(full, 0) + program.evaluate(acc, path, phases, convention)
            for ancestor in ancestors(prefix)[:-1]:
                if depth is None or path_depth(ancestor) <= depth:  # roll a submodule's graph up
                    out[ancestor] = out.get(ancestor, 0) + program.evaluate(acc, "", phases, convention)
        return out

    def reset(self) -> None:
        """Forget every accumulated call and step; restart the report timer."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:  # under the lock
        self._sums, self._pending = {}, {}
        self.calls = self.uncounted = self.steps = self.generated_tokens = 0
        self._started = time.perf_counter()

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (a capture) out of the next report's elapsed time."""
        self._started += seconds

    def step(self) -> None:
        """Close an optimizer step (after its microbatches): reports average over steps. The
        structure of every instrumented model is checked again on its next call (what torch's
        registration hooks do not see: ``param.data = ...``, a hook added; ``fxflops/situation.py``)."""
        with self._lock:
            self.steps += 1
        STRUCTURE.bump()

    def add_generated_tokens(self, count: int) -> None:
        """Tokens a ``generate`` call produced."""
        with self._lock:
            self.generated_tokens += count

    def symbol_total(self, name: str, _hosted: list | None = None) -> int | None:
        """Sum over the counted calls of one symbol's value (e.g. ``"tokens"``): 0 when nothing was
        counted, None when calls were counted and no program has a symbol of that name (a misspelt
        or zero-configuration name: ``input_ids_1``; see :meth:`symbol_names`)."""
        hosted = [entry for entry in (_hosted if _hosted is not None else self._on_host()) if entry[2] not in _AGAIN]  # calls once
        columns = [(acc, program.layout.column(name)) for program, acc, _, _ in hosted]
        if hosted and all(column is None for _, column in columns):
            return None
        return sum(acc[column] for acc, column in columns if column is not None)

    def symbol_names(self, _programs: list[Program] | None = None) -> list[str]:
        """The symbols of the programs that counted calls (the names ``report(tokens=...)`` takes)."""
        programs = [program for program, *_ in self._sums.values()] if _programs is None else _programs
        return sorted({str(m) for program in programs for m in program.layout.monomials if m.is_Symbol})

    def totals(
        self, depth: int | None = 1, convention: Convention | None = None, counters: dict[str, str | None] | None = None,
        _snapshot: _Snapshot | None = None,
    ) -> dict[str, Any]:
        """Everything a report needs, as exact Python ints (the payload of :meth:`all_reduce`):
        device accumulators are copied to the host once. ``counters`` maps a name (``tokens``) to the
        symbol whose sum it is."""
        snapshot = _snapshot or self._snapshot()
        hosted = snapshot.hosted
        useful = [self.breakdown(depth, phase, convention, hosted) for phase in PHASES if phase != "recompute"]
        sums = {name: self.symbol_total(symbol, hosted) for name, symbol in (counters or {}).items() if symbol}
        sums = {name: total for name, total in sums.items() if total is not None}  # no such symbol: unknown, not 0
        malformed: dict[str, int] = {}
        for program, acc, kind, _ in hosted:
            if kind in _AGAIN:  # the call's forward entry has it
                continue
            for name, n in program.malformed(acc).items():
                malformed[name] = malformed.get(name, 0) + n
        return sums | {
            "phases": {ph: self.total(ph, convention, hosted) for ph in PHASES},
            "modules": {path: sum(by_path.get(path, 0) for by_path in useful) for path in set().union(*useful)},
            "generated_tokens": snapshot.generated_tokens,
            "calls": snapshot.calls - sum(malformed.values()),
            "uncounted": snapshot.uncounted + sum(malformed.values()),
            "malformed": malformed,
            "steps": snapshot.steps,
        }

    def all_reduce(self, totals: dict[str, Any], group: Any = None) -> dict[str, Any]:
        """Sum :meth:`totals` payloads over a ``torch.distributed`` group with one collective
        (``all_gather_object``: exact Python ints, module paths that differ between ranks — pipeline
        stages — merged by name). Steps are the maximum over ranks, not a sum."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, totals, group=group)
        merged: dict[str, Any] = {
            "phases": {}, "modules": {}, "malformed": {}, "calls": 0, "uncounted": 0, "steps": 0, "generated_tokens": 0,
        }
        for part in gathered:
            for key in ("phases", "modules", "malformed"):
                for name, value in part[key].items():
                    merged[key][name] = merged[key].get(name, 0) + value
            merged["calls"] += part["calls"]
            merged["uncounted"] += part["uncounted"]
            merged["generated_tokens"] += part["generated_tokens"]
            merged["steps"] = max(merged["steps"], part["steps"])
            for counter in ("tokens", "images"):
                if counter in part:
                    merged[counter] = merged.get(counter, 0) + part[counter]
        return merged

    def report(
        self,
        elapsed_s: float | None = None,
        *,
        depth: int | None = 1,
        convention: Convention | None = None,
        peak_flops: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        tokens: str | None = None,
        images: str | None = None,
        group: Any = None,
        all_ranks: bool = True,
        reset: bool = True,
    ) -> Report:
        """A :class:`Report` of everything since the last report (then the meter starts over).

        ``elapsed_s`` defaults to the wall time since the last report (on an accelerator, synchronise
        before timing). ``peak_flops`` (per device) overrides the peak table; otherwise the peak of
        ``device``'s name and ``dtype`` is looked up (no MFU, with the reason, when unknown).
        ``tokens``/``images`` name the symbols whose sums are the tokens and images processed. With a
        ``torch.distributed`` group (or the default one when initialised with several ranks) the
        numbers are summed over it in one collective and TFLOP/s are per GPU: then every rank of the
        group must call ``report()`` (log on one), as for any collective — called on one rank alone it
        waits for the others. ``all_ranks=False`` reports this rank's own numbers, with no collective
        (safe inside ``if rank == 0:``).
        """
        import torch.distributed as dist

        from fxflops.conventions import FLOPCOUNTER
        from fxflops.peaks import lookup_peak

        convention = as_convention(convention)
        snapshot = self._snapshot(take=reset)  # what the report covers; with reset, the meter starts over here
        elapsed = time.perf_counter() - snapshot.started if elapsed_s is None else elapsed_s
        programs = [program for program, *_ in snapshot.hosted]
        named = convention or next((p.convention for p in programs), FLOPCOUNTER)
        totals = self.totals(depth, convention, {"tokens": tokens, "images": images}, snapshot)
        for counter, symbol in (("tokens", tokens), ("images", images)):
            if symbol and counter not in totals and snapshot.calls:
                warn(f"fxflops: report({counter}={symbol!r}): no program has a symbol of that name, so {counter} per second "
                     f"are unknown; the programs' symbols: {', '.join(self.symbol_names(programs)) or 'none'}", stacklevel=2)
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        distributed = all_ranks and (group is not None or several)
        world_size = dist.get_world_size(group) if distributed else 1
        alone = not all_ranks and several
        if distributed:
            totals = self.all_reduce(totals, group)
        if peak_flops is not None and not float(peak_flops) > 0:  # 0, negative or NaN: no utilisation to divide by
            peak, source = None, f"peak_flops={peak_flops!r} given by the user is not a positive number"
        elif peak_flops is not None:
            peak, source = float(peak_flops), "given by the user"
        else:
            peak, source = lookup_peak(device, dtype)
        report = Report(
            steps=max(totals["steps"], 1),
            elapsed_s=elapsed,
            world_size=world_size,
            convention=named,
            flops=totals["phases"],
            modules=totals["modules"],
            tokens=totals.get("tokens"),
            images=totals.get("images"),
            peak_flops=peak,
            peak_source=source,
            calls=totals["calls"],
            uncounted=totals["uncounted"],
            generated_tokens=totals["generated_tokens"],
            malformed=totals["malformed"],
            unsupported=sorted({u.op for p in programs for u in p.unsupported}),
            measured=_measured(programs),
            rank=dist.get_rank() if alone else None,
        )
        if report.malformed:
            warn(f"fxflops: {report.malformed_text()}", stacklevel=2)
        return report

    def table(self, depth: int | None = None, convention: Convention | None = None) -> str:
        """The accumulated breakdown as a readable table, headed by the convention it counts in."""
        from fxflops.conventions import FLOPCOUNTER
        from fxflops.report import meter_table

        convention = as_convention(convention)
        named = convention or next((p.convention for p, *_ in self._sums.values()), FLOPCOUNTER)
        measured = "".join(f"\nmeasured per call: {path or '<root>'}'s own code ({why.splitlines()[0][:160]})" for path, why in self.measured().items())
        return f"convention {named.describe()}{measured}\n" + meter_table(self.breakdown(depth, convention=convention))

    def measured(self) -> dict[str, str]:
        """Modules whose own code was measured per call in the counted calls (``fxflops/islands.py``),
        and why (the refusal of their symbolic capture, with its line)."""
        return _measured([program for program, *_ in list(self._sums.values())])


def _measured(programs: list[Program]) -> dict[str, str]:
    found: dict[str, str] = {}
    for program in programs:
        found.update(program.measured)
    return found


@dataclass
class _Snapshot:
    """A meter's accumulators on the host and its counters, at one instant."""

    hosted: list[tuple[Program, list[int], str, str]]
    calls: int
    uncounted: int
    steps: int
    generated_tokens: int
    started: float


@dataclass
class Report:
    """What a training run logs every N steps (see :meth:`Meter.report`). FLOPs are global (summed
    over ranks; ``rank`` set: that rank's own, ``report(all_ranks=False)``); rates are per GPU.
    ``peak_flops`` is ``None`` when the device's peak is unknown: then there is no MFU and
    ``peak_source`` says why."""

    steps: int
    elapsed_s: float
    world_size: int
    convention: Convention
    flops: dict[str, int]  # by phase, over the reported steps
    modules: dict[str, int]  # model FLOPs (every phase but recompute) per module path
    tokens: int | None = None
    images: int | None = None
    peak_flops: float | None = None
    peak_source: str = ""
    calls: int = 0
    uncounted: int = 0
    malformed: dict[str, int] = field(default_factory=dict)  # metadata input -> calls its device metadata broke
    generated_tokens: int = 0  # tokens generate() produced (every row's, prompt excluded)
    unsupported: list[str] = field(default_factory=list)  # ops with no rule: FLOPs are a lower bound
    measured: dict[str, str] = field(default_factory=dict)  # module -> why its own code was measured per call
    rank: int | None = None  # the rank whose own numbers these are in a multi-rank run (no collective)

    def malformed_text(self) -> str:
        """The calls whose metadata on a device was malformed, or whose sizes derived on a device fell
        outside their program's guards (``fxflops/guards.py``), in words (they are in ``uncounted``)."""
        parts = ", ".join(f"{n} call(s) with {name!r}" for name, n in sorted(self.malformed.items()) if name != OUTSIDE_KEY)
        said = [] if not parts else [
            f"malformed segment metadata on a device ({parts}: offsets not from 0, decreasing, past the packed "
            "length, or not covering a per-segment module's rows)"
        ]
        if self.malformed.get(OUTSIDE_KEY):  # e.g. frames that are all padding, which the host would measure
            said.append(f"{self.malformed[OUTSIDE_KEY]} call(s) with {OUTSIDE_KEY}")
        return "; ".join(said) + "; those calls were not counted"

    @property
    def model_flops(self) -> int:
        """Forward + backward, and generation's prefill + decode (MFU's numerator)."""
        return sum(flops for phase, flops in self.flops.items() if phase != "recompute")

    @property
    def hardware_flops(self) -> int:
        """Model FLOPs + recompute (HFU's numerator)."""
        return self.model_flops + self.flops.get("recompute", 0)

    @property
    def generated_tokens_per_s(self) -> float | None:
        return None if not self.generated_tokens or self.elapsed_s <= 0 else self.generated_tokens / self.elapsed_s

    @property
    def flops_per_generated_token(self) -> float | None:
        """(prefill + decode) FLOPs / generated tokens."""
        if not self.generated_tokens:
            return None
        return (self.flops.get("prefill", 0) + self.flops.get("decode", 0)) / self.generated_tokens

    def _per_gpu_per_s(self, flops: int) -> float:
        return flops / self.elapsed_s / self.world_size if self.elapsed_s > 0 else 0.0

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU: global model FLOPs / time / world size / 1e12 (Megatron's unit)."""
        return self._per_gpu_per_s(self.model_flops) / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation against the device's dense peak, or None when the peak is unknown."""
        return None if self.peak_flops is None else self._per_gpu_per_s(self.model_flops) / self.peak_flops

    @property
    def hfu(self) -> float | None:
        """Hardware FLOPs utilisation (recompute included), or None when the peak is unknown."""
        return None if self.peak_flops is None else self._per_gpu_per_s(self.hardware_flops) / self.peak_flops

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tokens is None or self.elapsed_s <= 0 else self.tokens / self.elapsed_s

    @property
    def images_per_s(self) -> float | None:
        return None if self.images is None or self.elapsed_s <= 0 else self.images / self.elapsed_s

    def metrics(self, prefix: str = "fxflops/") -> dict[str, float]:
        """A flat dict of numbers for any logger (TensorBoard, W&B, a Trainer's logs)."""
        out: dict[str, float] = {
            f"{prefix}flops_per_step": self.hardware_flops / self.steps,
            f"{prefix}model_flops_per_step": self.model_flops / self.steps,
            f"{prefix}tflops_per_gpu": self.tflops_per_gpu,
        }
        for phase, flops in self.flops.items():
            out[f"{prefix}{phase}_flops_per_step"] = flops / self.steps
        if self.mfu is not None:
            out[f"{prefix}mfu"] = self.mfu
            out[f"{prefix}hfu"] = self.hfu
        if self.tokens_per_s is not None:
            out[f"{prefix}tokens_per_s"] = self.tokens_per_s
        if self.images_per_s is not None:
            out[f"{prefix}images_per_s"] = self.images_per_s
        if self.generated_tokens:
            out[f"{prefix}generated_tokens_per_s"] = self.generated_tokens_per_s
            out[f"{prefix}flops_per_generated_token"] = self.flops_per_generated_token
        total = self.modules.get("", 0) or 1
        for path, flops in self.modules.items():
            if path:
                out[f"{prefix}share/{path}"] = flops / total
                out[f"{prefix}tflops_per_gpu/{path}"] = self._per_gpu_per_s(flops) / 1e12
        return out

    def __str__(self) -> str:
        mfu = f"MFU {100 * self.mfu:.1f}% HFU {100 * self.hfu:.1f}%" if self.mfu is not None else f"no MFU ({self.peak_source})"
        lines = [
            f"{self.steps} step(s) in {self.elapsed_s:.3f} s {self._where_text()}: "
            f"{self.tflops_per_gpu:.4g} TFLOP/s per GPU{self._divisor_text()}, {mfu}",
            f"  per step: fwd {self.flops.get('fwd', 0) / self.steps:,.0f}  bwd {self.flops.get('bwd', 0) / self.steps:,.0f}  "
            f"recompute {self.flops.get('recompute', 0) / self.steps:,.0f} FLOPs ({self.convention.name})",
        ]
        if self.generated_tokens:
            lines.append(
                f"  generation: prefill {self.flops.get('prefill', 0):,}  decode {self.flops.get('decode', 0):,} FLOPs, "
                f"{self.generated_tokens:,} tokens generated ({self.generated_tokens_per_s:,.1f}/s), "
                f"{self.flops_per_generated_token:,.0f} FLOPs per generated token"
            )
        if self.tokens_per_s is not None:
            lines.append(f"  {self.tokens_per_s:,.0f} tokens/s" + (f", {self.images_per_s:,.1f} images/s" if self.images_per_s is not None else ""))
        total = self.modules.get("", 0) or 1
        for path, flops in self.modules.items():
            if path and flops:
                lines.append(f"  {path:<24} {100 * flops / total:5.1f}%  {self._per_gpu_per_s(flops) / 1e12:.4g} TFLOP/s")
        if self.uncounted:
            lines.append(f"  {self.uncounted} call(s) not counted (see the warnings)")
        if self.malformed:
            lines.append(f"  {self.malformed_text()}")
        if self.unsupported:
            lines.append(f"  lower bound: ops without a FLOPs rule ran: {', '.join(self.unsupported)}")
        for path, reason in self.measured.items():
            lines.append(f"  measured per call: {path or '<root>'}'s own code ({reason.splitlines()[0][:160]})")
        return "\n".join(lines)

    def _where_text(self) -> str:
        return f"on {self.world_size} device(s)" if self.rank is None else f"on rank {self.rank} alone (all_ranks=False)"

    def _divisor_text(self) -> str:
        return f" (the {self.world_size} ranks' global FLOPs / time / {self.world_size})" if self.world_size > 1 else ""


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
