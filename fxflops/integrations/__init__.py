"""Training-framework callbacks that log fxflops' exact FLOPs, TFLOP/s and MFU.

Both callbacks read the :class:`~fxflops.meter.Meter` of an ``fxflops.instrument(model, backward=True)``
wrapper (or of anything with a ``.flops`` Meter, or a Meter itself), close one meter step per
optimizer step, and every logging interval turn the meter into a :class:`~fxflops.meter.Report`
(then the meter starts over) whose ``metrics(prefix)`` — ``fxflops/model_flops_per_step``,
``fxflops/flops_per_step``, ``fxflops/{fwd,bwd,recompute}_flops_per_step``, ``fxflops/tflops_per_gpu``,
``fxflops/mfu``/``fxflops/hfu`` (when the peak is known), ``fxflops/tokens_per_s``/``images_per_s``
(when their symbols are named), ``fxflops/share/<module>`` and ``fxflops/tflops_per_gpu/<module>`` —
go to the framework's loggers. The last report is kept on ``callback.last_report``.

- :mod:`fxflops.integrations.hf_trainer`: ``FlopsCallback``, a ``transformers.TrainerCallback``.
  ``on_step_end`` closes a step; ``on_log`` reports and adds the metrics to the Trainer's ``logs``
  dict in place (and to ``trainer.state.log_history``). Call ``callback.attach(trainer)`` so that the
  reporting integrations (TensorBoard, W&B, ...), which the Trainer calls *before* user callbacks,
  see them too.
- :mod:`fxflops.integrations.lightning`: ``FlopsCallback``, a ``pytorch_lightning.Callback``. One step
  per optimizer step (gradient accumulation and manual optimization respected), a report every N
  optimizer steps logged with ``pl_module.log_dict``; Lightning's own
  ``lightning_fabric.utilities.throughput.Throughput`` is fed the exact FLOPs and its values are
  logged under ``fxflops/throughput/...``.

Evaluation forwards made through the wrapper while training are kept out of the training numbers
(the wrapper counts into a scratch meter during evaluation, and evaluation time is not training time).
Nothing here stops training: an error while reporting is warned about once and the step goes on.

The optional dependencies (``transformers``, ``pytorch_lightning``/``lightning_fabric``) are imported
only by the submodule that needs them, when that submodule is imported: ``import fxflops`` and
``import fxflops.integrations`` import neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fxflops.errors import warn
from fxflops.meter import Meter


def _resolve(source: Any) -> tuple[Meter | None, Any]:
    """(the Meter, the object holding it) for a wrapper, anything with a ``.flops`` Meter, or a Meter."""
    if source is None:
        return None, None
    if isinstance(source, Meter):
        return source, None
    meter = getattr(source, "flops", None)
    if isinstance(meter, Meter):
        return meter, source
    raise TypeError(
        f"FlopsCallback needs an fxflops.instrument() wrapper, an object with a .flops Meter, or a Meter; "
        f"got {type(source).__name__}"
    )


def _find_wrapper(model: Any) -> Any:
    """The first ``fxflops.instrument`` wrapper inside ``model`` (itself included), or None."""
    from fxflops.instrument import Instrumented

    if isinstance(model, torch.nn.Module):
        for module in model.modules():
            if isinstance(module, Instrumented):
                return module
    return None


def _holders(meter: Meter, owner: Any, model: Any) -> list[Any]:
    """Every object whose ``.flops`` is ``meter``: ``owner`` and the wrappers inside ``model``."""
    from fxflops.instrument import Instrumented

    found: list[Any] = []
    candidates: Iterator[Any] = iter(())
    if isinstance(model, torch.nn.Module):
        candidates = (m for m in model.modules() if isinstance(m, Instrumented))
    for obj in (owner, *candidates):
        if obj is not None and getattr(obj, "flops", None) is meter and all(obj is not f for f in found):
            found.append(obj)
    return found


class _Isolation:
    """Counts evaluation forwards into a scratch meter: swaps the ``.flops`` of every holder of the
    training meter for the duration, and measures how long it lasted (not training time). (A program
    the wrapper captures during evaluation is kept: a wrapper with a backward captures it with grad
    enabled, so training calls can use it.)"""

    def __init__(self) -> None:
        self.active: list[tuple[Any, Meter]] = []
        self.started: float | None = None

    def begin(self, meter: Meter, holders: list[Any], now: float) -> None:
        if self.started is not None:
            return
        scratch = Meter()
        self.active = [(holder, meter) for holder in holders]
        for holder in holders:
            holder.flops = scratch
        self.started = now

    def end(self, now: float) -> float:
        """Restore the training meter; the seconds the isolation lasted (0 if it was not active)."""
        if self.started is None:
            return 0.0
        for holder, meter in self.active:
            holder.flops = meter
        elapsed, self.active, self.started = now - self.started, [], None
        return elapsed


class _Reporting:
    """What both callbacks share: the report options, the meter, and making a report."""

    def _options(
        self,
        source: Any,
        peak_flops: float | None,
        device: Any,
        dtype: torch.dtype | None,
        depth: int | None,
        convention: Any,
        tokens: str | None,
        images: str | None,
        prefix: str,
        synchronize: bool,
    ) -> None:
        self.meter, self._owner = _resolve(source)
        self.peak_flops = peak_flops
        self.device = device
        self.dtype = dtype
        self.depth = depth
        self.convention = convention
        self.tokens = tokens
        self.images = images
        self.prefix = prefix
        self.synchronize = synchronize
        self.last_report = None
        self._model: Any = None

    def _make_report(self, elapsed: float, device: Any, dtype: torch.dtype) -> Any:
        """A report of the meter over ``elapsed`` seconds, kept on ``last_report``."""
        self.last_report = self.meter.report(
            elapsed,
            depth=self.depth,
            convention=self.convention,
            peak_flops=self.peak_flops,
            device=device,
            dtype=dtype,
            tokens=self.tokens,
            images=self.images,
        )
        return self.last_report


def _synchronize(device: Any) -> None:
    """Wait for the accelerator (so host timing covers the work), no-op on the CPU."""
    if device is None:
        return
    device = torch.device(device)
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "synchronize"):
        if hasattr(module, "is_available") and not module.is_available():
            return
        module.synchronize(device)


class _WarnOnce:
    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, message: str) -> None:
        if message not in self.seen:
            self.seen.add(message)
            warn(f"fxflops: {message}", stacklevel=3)
