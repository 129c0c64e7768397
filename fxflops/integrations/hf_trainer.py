"""``FlopsCallback`` for the Hugging Face ``transformers.Trainer``.

```python
import fxflops
from fxflops.integrations.hf_trainer import FlopsCallback

wrapper = fxflops.instrument(model, backward=True)           # counts fwd + bwd of every training call
args = TrainingArguments(..., label_names=["labels"])       # see below
trainer = Trainer(model=wrapper, args=args, train_dataset=...)
FlopsCallback(wrapper, peak_flops=989e12).attach(trainer)    # or Trainer(callbacks=[FlopsCallback(...)])
trainer.train()
```

- ``on_step_end`` (once per optimizer step, after all its gradient-accumulation microbatches) closes a
  meter step.
- ``on_log`` makes a :class:`~fxflops.meter.Report` of the steps since the previous log (elapsed time:
  ``time.perf_counter()`` marks kept by the callback, the accelerator synchronised first; evaluation
  time excluded) and adds ``report.metrics(prefix)`` to the ``logs`` dict in place and to the matching
  ``trainer.state.log_history`` entry; the report is kept on ``callback.last_report``. A log with no
  step since the previous one (the end-of-training summary right after a log, evaluation logs) gets
  nothing.

Things about the Trainer worth knowing:

- The Trainer calls the reporting integrations (TensorBoard, W&B, MLflow, ...) *before* the callbacks
  passed to it, with the same ``logs`` dict, and copies ``logs`` into ``state.log_history`` before any
  callback runs. A callback given through ``Trainer(callbacks=[...])`` therefore reaches the
  printer/progress callback and ``log_history`` (patched here) but not the integrations:
  :meth:`FlopsCallback.attach` moves (or adds) it right after the ``DefaultFlowCallback``, ahead of
  them. Without ``attach`` and with ``report_to`` naming integrations, a warning says so once.
- The Trainer keeps only the dataset columns that are parameters of ``model.forward``: the wrapper's
  ``forward`` carries the model's signature, so this works as with the bare model. The default label
  names come from the model *class*'s ``forward`` (the wrapper class takes ``*args, **kwargs``): pass
  ``label_names=["labels"]`` so that evaluation reports a loss.
- Evaluation inside ``train()`` (``eval_strategy``) runs right after the step's log; the callback sees
  it coming (``control.should_evaluate``, set by the ``DefaultFlowCallback`` before this callback's
  ``on_step_end``/``on_epoch_end``) and counts the evaluation forwards into a scratch meter until
  ``on_evaluate``, so they are not training FLOPs (this needs the wrapper, not a bare Meter);
  ``eval_on_start`` too. ``trainer.evaluate()`` outside of ``train()`` is not isolated.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DefaultFlowCallback, TrainerCallback

from fxflops.integrations import (
    _find_wrapper,
    _holders,
    _Isolation,
    _Reporting,
    _synchronize,
    _WarnOnce,
)

__all__ = ["FlopsCallback"]


class FlopsCallback(TrainerCallback, _Reporting):
    """Log fxflops' exact FLOPs, TFLOP/s per GPU and MFU with every Trainer log (module docstring).

    ``source``: the ``fxflops.instrument`` wrapper (or anything with a ``.flops`` Meter, or the Meter);
    ``None``: the first wrapper found inside the Trainer's model when training begins.
    ``peak_flops``, ``device``, ``dtype``, ``depth``, ``convention``, ``tokens``, ``images`` as for
    :meth:`Meter.report` (``device`` defaults to ``args.device``; ``dtype`` to bf16/fp16 from the
    training arguments, else float32); ``prefix`` starts every metric name. The meter is reset when
    training begins, so calls made before ``train()`` are not counted.
    """

    def __init__(
        self,
        source: Any = None,
        *,
        peak_flops: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        depth: int | None = 1,
        convention: Any = None,
        tokens: str | None = None,
        images: str | None = None,
        prefix: str = "fxflops/",
        synchronize: bool = True,
    ) -> None:
        self._options(source, peak_flops, device, dtype, depth, convention, tokens, images, prefix, synchronize)
        self.attached = False
        self._mark: float | None = None
        self._excluded = 0.0
        self._eval_pending = False
        self._last_log_step = -1
        self._isolation = _Isolation()
        self._warn = _WarnOnce()

    def attach(self, trainer: Any) -> FlopsCallback:
        """Put this callback right after the Trainer's ``DefaultFlowCallback`` (added if missing),
        ahead of the reporting integrations, so that they log the metrics it adds. Returns self."""
        callbacks = trainer.callback_handler.callbacks
        if any(cb is self for cb in callbacks):
            callbacks.remove(self)
        flow = next((i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), -1)
        callbacks.insert(flow + 1, self)
        self.attached = True
        return self

    # --- hooks -------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        try:
            self._model = model
            if self.meter is None:
                wrapper = _find_wrapper(model)
                if wrapper is None:
                    self._warn("FlopsCallback found no fxflops.instrument() wrapper in the model: not logging FLOPs")
                    return
                self.meter, self._owner = wrapper.flops, wrapper
            self.meter.reset()
            self._mark = time.perf_counter()
            self._excluded = 0.0
            self._last_log_step = state.global_step
            if getattr(args, "eval_on_start", False):
                self._begin_evaluation()  # the Trainer evaluates right after on_train_begin
            report_to = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
            if not self.attached and any(r not in (None, "none") for r in report_to):
                self._warn(
                    f"the Trainer calls its reporting integrations ({', '.join(map(str, report_to))}) before "
                    "FlopsCallback, so they will not log its metrics: call callback.attach(trainer)"
                )
        except Exception as exc:  # noqa: BLE001 -- never stop training
            self._warn(f"FlopsCallback.on_train_begin failed: {exc!r}")

    def on_step_end(self, args, state, control, **kwargs):
        if self.meter is None:
            return
        self.meter.step()
        self._expect_evaluation(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.meter is not None:
            self._expect_evaluation(state, control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.meter is None or self._mark is None or self._isolation.started is not None:
            return  # not training, or an evaluation log
        try:
            if self.meter.steps > 0:
                self._log(args, state, logs)
        except Exception as exc:  # noqa: BLE001 -- never stop training
            self._warn(f"FlopsCallback could not report: {exc!r}")
        finally:
            self._last_log_step = state.global_step
            if self._eval_pending:
                self._begin_evaluation()

    def on_evaluate(self, args, state, control, **kwargs):
        self._eval_pending = False
        self._excluded += self._isolation.end(time.perf_counter())

    # --- internals ---------------------------------------------------------------------------------

    def _expect_evaluation(self, state, control) -> None:
        """An evaluation follows this step (or epoch) after its log, if any: isolate it from then on."""
        if not control.should_evaluate or self._mark is None:
            return
        log_follows = control.should_log and state.global_step > self._last_log_step
        if log_follows:
            self._eval_pending = True  # begins at the end of on_log
        else:
            self._begin_evaluation()

    def _begin_evaluation(self) -> None:
        self._eval_pending = False
        holders = _holders(self.meter, self._owner, self._model)
        if not holders:
            self._warn("evaluation forwards are counted with training (FlopsCallback was given a bare Meter)")
            return
        self._isolation.begin(self.meter, holders, time.perf_counter())

    def _log(self, args, state, logs: dict[str, float] | None) -> None:
        device = self.device if self.device is not None else args.device
        if self.synchronize:
            _synchronize(device)
        now = time.perf_counter()
        elapsed = now - self._mark - self._excluded
        self._mark, self._excluded = now, 0.0
        dtype = self.dtype or (torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32)
        report = self._make_report(elapsed, device, dtype)
        if report.uncounted:
            self._warn(f"{report.uncounted} call(s) could not be counted (see fxflops' warning)")
        metrics = report.metrics(self.prefix)
        if logs is not None:
            entry = state.log_history[-1] if state.log_history else None
            if isinstance(entry, dict) and entry.keys() - {"step"} == logs.keys():
                entry.update(metrics)  # the Trainer copied logs into log_history before calling back
            logs.update(metrics)
