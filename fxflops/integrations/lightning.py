"""``FlopsCallback`` for PyTorch Lightning (``pytorch_lightning``, 2.x).

```python
import fxflops
from fxflops.integrations.lightning import FlopsCallback

class LitModel(pytorch_lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = fxflops.instrument(MyModel(), backward=True)  # used in training_step
    ...

trainer = pytorch_lightning.Trainer(callbacks=[FlopsCallback(peak_flops=989e12)], log_every_n_steps=10)
trainer.fit(LitModel(), loader)
```

- **Steps.** ``on_train_batch_end`` closes a meter step when an optimizer step happened in that
  batch, detected as ``trainer.global_step`` having advanced since the previous batch end: Lightning
  increments it inside ``optimizer.step()``, before ``on_train_batch_end``. This is exactly
  ``not trainer.fit_loop._should_accumulate()`` under automatic optimization with
  ``accumulate_grad_batches`` (including the short accumulation Lightning steps on at the end of an
  epoch, which ``(batch_idx + 1) % accumulate_grad_batches == 0`` would miss), uses no private API, and
  also works under manual optimization (one meter step per batch in which any optimizer stepped).
- **Reports.** Every ``log_every_n_steps`` such batches (default: the Trainer's ``log_every_n_steps``),
  counted like Lightning's own logging cadence (its ``_batches_that_stepped``), the meter becomes a
  :class:`~fxflops.meter.Report` (elapsed: ``time.perf_counter()`` marks, accelerator synchronised,
  validation time excluded) kept on ``callback.last_report`` and logged with
  ``pl_module.log_dict(..., on_step=True, on_epoch=False)``: the keys of ``report.metrics(prefix)``.
- **Lightning's Throughput.** One ``lightning_fabric.utilities.throughput.Throughput`` (the class behind
  ``ThroughputMonitor``; ``pytorch_lightning.utilities`` has no ``throughput`` module in 2.6) is
  seeded with zeros at train start and updated at every report with ``time`` (training seconds so
  far), ``batches`` (training batches this rank has run), ``samples`` (from ``batch_size_fn``, default
  Lightning's ``extract_batch_size``), ``lengths`` (cumulative tokens per device, if ``tokens`` names
  a symbol) and ``flops`` = the report's exact model FLOPs (fwd + bwd) per device since the previous
  update; ``available_flops`` is the report's peak. Its ``compute()`` is logged under
  ``{prefix}throughput/``: ``time``, ``batches``, ``samples`` (``lengths``), and, once its window is
  full, ``device/batches_per_sec``, ``device/samples_per_sec`` (``device/items_per_sec``),
  ``device/flops_per_sec`` and ``device/mfu`` (with a known peak), plus the global (non-``device/``)
  rates when the world size is above 1. With ``window_size=2`` (the default) its rates cover exactly
  the report's interval, so ``device/flops_per_sec == tflops_per_gpu * 1e12`` and ``device/mfu ==
  mfu``; a larger window averages over the last ``window_size - 1`` reports. ``throughput=False``
  leaves it out.

Surprises in Lightning this works around:

- ``self.log`` turns a Python float into a float32 tensor (24-bit mantissa: 123456789 is logged as
  123456792); the metrics are passed as float64 tensors, so FLOPs reach the loggers exact up to 2⁵³.
- Values logged with ``self.log`` reach the loggers only on the Trainer's own cadence
  (``Trainer(log_every_n_steps=...)``, default 50): a report made on another step is overwritten
  before it is flushed. Keep this callback's ``log_every_n_steps`` a multiple of the Trainer's (the
  default is the Trainer's value; a mismatch is warned about once).
- Validation (the sanity check included) calls the same wrapper: between ``on_validation_start`` and
  ``on_validation_end`` the wrapper counts into a scratch meter, so those forwards are not training
  FLOPs, and that time is not training time (as ``ThroughputMonitor`` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning_fabric.utilities.throughput import Throughput
from pytorch_lightning import Callback

from fxflops.integrations import (
    _find_wrapper,
    _holders,
    _Isolation,
    _Reporting,
    _synchronize,
    _WarnOnce,
)
from fxflops.meter import Report

__all__ = ["FlopsCallback"]

_PRECISION_DTYPES = {
    "bf16": torch.bfloat16,
    "16": torch.float16,
    "32": torch.float32,
    "64": torch.float64,
}


def _precision_dtype(precision: Any) -> torch.dtype:
    """The compute dtype of a Lightning precision string ("bf16-mixed", "16-true", "32-true", ...)."""
    text = str(precision)
    head = text.split("-")[0]
    if head in _PRECISION_DTYPES:
        return _PRECISION_DTYPES[head]
    if "bf16" in text:
        return torch.bfloat16
    return torch.float32 if text.startswith("32") else torch.bfloat16


class FlopsCallback(Callback, _Reporting):
    """Log fxflops' exact FLOPs, TFLOP/s per GPU, MFU and Lightning's Throughput values (module docstring).

    ``source``: the ``fxflops.instrument`` wrapper (or anything with a ``.flops`` Meter, or the Meter);
    ``None``: the first wrapper found inside the LightningModule at setup. ``log_every_n_steps``:
    optimizer steps per report (default: the Trainer's). ``peak_flops``, ``device``, ``dtype``,
    ``depth``, ``convention``, ``tokens``, ``images`` as for :meth:`Meter.report` (``device`` defaults
    to the strategy's root device, ``dtype`` to the Trainer's precision). ``throughput``,
    ``window_size``, ``batch_size_fn``: Lightning's Throughput. The meter is reset at train start.
    """

    def __init__(
        self,
        source: Any = None,
        *,
        log_every_n_steps: int | None = None,
        peak_flops: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        depth: int | None = 1,
        convention: Any = None,
        tokens: str | None = None,
        images: str | None = None,
        prefix: str = "fxflops/",
        throughput: bool = True,
        window_size: int = 2,
        batch_size_fn: Callable[[Any], int] | None = None,
        synchronize: bool = True,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be >= 0, not {log_every_n_steps}")
        if window_size < 2:
            raise ValueError(f"window_size must be >= 2 (Throughput's rates need two updates), not {window_size}")
        self._options(source, peak_flops, device, dtype, depth, convention, tokens, images, prefix, synchronize)
        self.log_every_n_steps = log_every_n_steps
        self.use_throughput = throughput
        self.window_size = window_size
        self.batch_size_fn = batch_size_fn
        self.throughput: Throughput | None = None
        self._every = 0
        self._started: float | None = None
        self._mark = 0.0
        self._excluded = 0.0  # validation seconds since the last report
        self._excluded_total = 0.0  # validation seconds since train start
        self._last_global_step = 0
        self._stepped = 0
        self._batches = 0
        self._samples = 0
        self._tokens = 0
        self._isolation = _Isolation()
        self._warn = _WarnOnce()

    # --- hooks -------------------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._model = pl_module
        if self.meter is None:
            wrapper = _find_wrapper(pl_module)
            if wrapper is None:
                self._warn("FlopsCallback found no fxflops.instrument() wrapper in the LightningModule: no FLOPs")
                return
            self.meter, self._owner = wrapper.flops, wrapper

    def on_train_start(self, trainer, pl_module) -> None:
        if self.meter is None:
            return
        try:
            self._every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
            every_log = trainer.log_every_n_steps
            if trainer.loggers and self._every and (every_log == 0 or self._every % every_log):
                self._warn(
                    f"FlopsCallback(log_every_n_steps={self._every}) is not a multiple of the Trainer's "
                    f"log_every_n_steps={every_log}: Lightning flushes logged values to the loggers only "
                    "on its own cadence, so some reports will not reach them (see callback.last_report)"
                )
            self.meter.reset()
            self._started = self._mark = time.perf_counter()
            self._excluded = self._excluded_total = 0.0
            self._last_global_step = trainer.global_step
            self._stepped = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
            self._batches = self._samples = self._tokens = 0
            self.throughput = None
            if self.use_throughput:
                self.throughput = Throughput(world_size=trainer.world_size, window_size=self.window_size)
                self.throughput.update(time=0.0, batches=0, samples=0, lengths=0 if self.tokens else None, flops=0)
        except Exception as exc:  # noqa: BLE001 -- never stop training
            self._warn(f"FlopsCallback.on_train_start failed: {exc!r}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.meter is None or self._started is None:
            return
        try:
            self._batches += 1
            self._samples += self._batch_size(batch)
            if trainer.global_step <= self._last_global_step:
                return  # gradient accumulation: no optimizer step in this batch
            self._last_global_step = trainer.global_step
            self.meter.step()
            self._stepped += 1
            if self._every and self._stepped % self._every == 0:
                self._report(trainer, pl_module)
        except Exception as exc:  # noqa: BLE001 -- never stop training
            self._warn(f"FlopsCallback could not report: {exc!r}")

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.meter is None:
            return
        holders = _holders(self.meter, self._owner, self._model)
        if holders:
            self._isolation.begin(self.meter, holders, time.perf_counter())
        else:
            self._warn("validation forwards are counted with training (FlopsCallback was given a bare Meter)")

    def on_validation_end(self, trainer, pl_module) -> None:
        seconds = self._isolation.end(time.perf_counter())
        if self._started is not None:
            self._excluded += seconds
            self._excluded_total += seconds

    # --- internals ---------------------------------------------------------------------------------

    def _batch_size(self, batch: Any) -> int:
        if self.batch_size_fn is not None:
            return int(self.batch_size_fn(batch))
        from pytorch_lightning.utilities.data import extract_batch_size

        try:
            return int(extract_batch_size(batch))
        except Exception:  # noqa: BLE001
            self._warn("could not infer the batch size for Throughput's samples (give batch_size_fn): 1 per batch")
            return 1

    def _report(self, trainer, pl_module) -> None:
        device = self.device if self.device is not None else trainer.strategy.root_device
        if self.synchronize:
            _synchronize(device)
        now = time.perf_counter()
        elapsed = now - self._mark - self._excluded
        self._mark, self._excluded = now, 0.0
        report = self._make_report(elapsed, device, self.dtype or _precision_dtype(trainer.precision))
        if report.uncounted:
            self._warn(f"{report.uncounted} call(s) could not be counted (see fxflops' warning)")
        metrics = report.metrics(self.prefix)
        if self.throughput is not None:
            metrics.update(self._throughput(report, now - self._started - self._excluded_total))
        pl_module.log_dict(
            {k: torch.tensor(float(v), dtype=torch.float64) for k, v in metrics.items()},
            on_step=True,
            on_epoch=False,
            prog_bar=False,
            logger=bool(trainer.loggers),  # no logger: callback_metrics only, without Lightning's warning per key
            batch_size=1,
        )

    def _throughput(self, report: Report, seconds: float) -> dict[str, float]:
        """Update Lightning's Throughput with this report and return its values under the prefix."""
        world = max(report.world_size, 1)
        flops = report.model_flops if world == 1 else report.model_flops / world
        lengths = None
        if self.tokens is not None and report.tokens is not None:
            self._tokens += report.tokens
            lengths = self._tokens // world
        try:
            self.throughput.available_flops = report.peak_flops
            self.throughput.update(
                time=seconds, batches=self._batches, samples=self._samples, lengths=lengths, flops=flops
            )
            values = self.throughput.compute()
        except (ValueError, RuntimeError) as exc:  # non-increasing counters (e.g. an empty interval)
            self._warn(f"Lightning's Throughput refused an update: {exc}")
            return {}
        return {f"{self.prefix}throughput/{key}": float(value) for key, value in values.items()}
