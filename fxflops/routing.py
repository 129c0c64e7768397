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

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxflops.rules import entry_for
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
    """Adds up :func:`dispatched_flops` of every op run while active (``.flops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: Any = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops = self.flops + dispatched_flops(func, args, kwargs, out)
        return out


class RoutingProbes:
    """Measuring wrappers on the expert modules of a model (installed while counting, removed while
    capturing); ``take()`` returns and clears ``{module path: forward FLOPs}`` since the last take."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.paths: set[str] = set()
        self.measured: dict[str, Any] = {}

    def watch(self, paths: tuple[str, ...]) -> None:
        """Measure the modules at ``paths`` from now on."""
        for path in paths:
            if path not in self.paths:
                self.paths.add(path)
                self._install(path)

    def _install(self, path: str) -> None:
        module = self.model.get_submodule(path)
        original: Callable[..., Any] = type(module).forward.__get__(module)

        def forward(*args: Any, **kwargs: Any) -> Any:
            with MatmulMeasure() as measure:
                out = original(*args, **kwargs)
            self.measured[path] = self.measured.get(path, 0) + measure.flops
            return out

        module.forward = forward

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The wrappers taken off (while capturing: the trace must see the module's own forward)."""
        for path in self.paths:
            module = self.model.get_submodule(path)
            if "forward" in module.__dict__:
                del module.forward
        try:
            yield
        finally:
            for path in self.paths:
                self._install(path)

    def take(self) -> dict[str, Any]:
        measured, self.measured = self.measured, {}
        return measured
