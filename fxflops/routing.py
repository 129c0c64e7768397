"""Routing probes: the FLOPs a mixture-of-experts layer really dispatched, measured per call.

Which tokens reach which expert is data, so the traced program counts routed experts at
top_k × tokens × expert cost (``moe="model"``: what a dropless dispatch computes and MFU formulas
assume). A dispatch can compute fewer rows (tokens dropped beyond an expert's capacity: rows past a
grouped GEMM's last offset are not computed), more (groups padded to an alignment) or rows of
different cost (uneven experts). ``moe="actual"`` counts those rows.

``fxflops.instrument(model, measure_routing=True)`` wraps the forward of each of a program's expert
modules (``Program.experts``: the innermost module reading the router's top-k indices) so that it runs
under :class:`MatmulMeasure`, a dispatch mode scoped to that module alone. It adds up the forward FLOPs
of the module's matrix products from their concrete shapes with fxflops' own rules; a grouped GEMM
``_grouped_mm(x, w, offs)`` with 2-D ``x`` and 3-D ``w`` computes the rows up to its last offset,
2·K·N·offs[-1], read with a tensor op on the offsets' device (a 0-d tensor the Meter accumulates
there: no host sync). The measured value fills the program's ``routed_i`` column for the call; the
backward is the traced ratio of the module's backward to its forward (``Program`` docstring).
Only the expert modules run under the mode; the rest of the model is untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxflops.rules import entry_for, overlaid
from fxflops.rules.registry import shape_of


def dispatched_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """Forward FLOPs of one executed op (an int, or a 0-d int64 tensor on the offsets' device for a
    grouped GEMM whose offsets live there); 0 for ops that are not matrix products."""
    if getattr(func, "overloadpacket", None) is torch.ops.aten._grouped_mm:
        x, w = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        if offs is not None and x.dim() == 2 and w.dim() == 3:
            rows = offs[-1].to(torch.int64)  # rows past the last offset are not computed
            return rows.item() * 2 * w.shape[1] * w.shape[2] if rows.is_cpu else rows * (2 * w.shape[1] * w.shape[2])
    entry = entry_for(func)
    if entry is None or entry.kind != "matmul":
        return 0
    return int(entry.rule(*shape_of(args), out_shape=shape_of(out), **{k: shape_of(v) for k, v in kwargs.items()}))


class MatmulMeasure(TorchDispatchMode):
    """Adds up :func:`dispatched_flops` of every op run while active (``.flops``). The model's ops
    run and raise as they would; a failure of the accounting itself never reaches the model: it is
    kept in ``error`` and the measurement is void."""

    def __init__(self, rules: Mapping[Any, Any] | None = None) -> None:
        super().__init__()
        self.flops: Any = 0
        self.error: Exception | None = None
        self.rules = rules  # the per-use rules of the program (rules.overlaid)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.error is None:
            try:
                if self.rules:
                    with overlaid(self.rules):
                        self.flops = self.flops + dispatched_flops(func, args, kwargs, out)
                else:
                    self.flops = self.flops + dispatched_flops(func, args, kwargs, out)
            except Exception as exc:  # noqa: BLE001 - telemetry never breaks the model's forward
                self.error = exc
        return out


class MeasuredForward:
    """An expert module's forward run under :class:`MatmulMeasure`, its FLOPs added to the probes'
    ``measured`` (a picklable object, so that a model carrying probes can still be saved). Not part
    of the model's structure for call situations (``fxflops/situation.py``): ``fxflops_own``."""

    fxflops_own = True

    def __init__(self, probes: RoutingProbes, path: str, forward: Callable[..., Any]) -> None:
        self.probes, self.path, self.forward = probes, path, forward

    @property
    def fxflops_wraps(self) -> Callable[..., Any]:
        """The module's own forward: what a capture's twin of the model runs (``capture/isolation.py``)."""
        return self.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with MatmulMeasure(self.probes.rules) as measure:
            out = self.forward(*args, **kwargs)
        if measure.error is None:
            measured = self.probes.measured
            measured[self.path] = measured.get(self.path, 0) + measure.flops
        else:  # this call's routing is not measured (moe="actual" then refuses it, naming the modules)
            self.probes.errors.append(f"{self.path}: {type(measure.error).__name__}: {measure.error}")
        return out


class RoutingProbes:
    """Measuring wrappers on the expert modules of a model (inactive while capturing); ``take()``
    returns and clears ``{module path: forward FLOPs}`` since the last take; ``errors`` lists
    measurements that failed (their calls count as not measured)."""

    def __init__(self, model: torch.nn.Module, rules: Mapping[Any, Any] | None = None) -> None:
        self.model = model
        self.rules = rules  # per-use rules (instrument(rules=...)), applied to the measurements too
        self.paths: set[str] = set()
        self.measured: dict[str, Any] = {}
        self.errors: list[str] = []

    def watch(self, paths: tuple[str, ...]) -> None:
        """Measure the modules at ``paths`` from now on."""
        for path in paths:
            if path not in self.paths:
                self.paths.add(path)
                self._install(path)

    def _install(self, path: str) -> None:
        module = self.model.get_submodule(path)
        module.forward = MeasuredForward(self, path, type(module).forward.__get__(module))

    def take(self) -> dict[str, Any]:
        measured, self.measured = self.measured, {}
        return measured
