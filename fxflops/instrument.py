"""``instrument(model)``: a wrapper that counts every call's FLOPs from its shapes.

The wrapper's forward runs the model unchanged and returns its output. The first call is the example:
the model is captured symbolically (fake tensors, no real compute) into a :class:`Program`. Each call
binds the free symbols from the argument shapes, checks the trace's guards and adds the monomial
vector to ``wrapper.flops`` (a :class:`Meter`). Nothing is attached to the model: no hooks, no modes;
the wrapper shares the model's parameter, buffer and submodule dicts, so ``state_dict()`` keys,
``parameters()`` and ``.to()`` are the model's own.

A call outside every captured program's guards (or with a different input layout) is re-captured as
a new branch of a piecewise program (``on_miss="recapture"``, the default) or refused with
:class:`GuardError` (``on_miss="raise"``). Counting never stops training unless ``strict=True``: a
capture that fails is reported once as a warning and the call is marked uncounted.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import types
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxflops.capture.adapters import adapter_for
from fxflops.capture.trace import capture
from fxflops.errors import CaptureError, FxFlopsError, GuardError, InputError
from fxflops.meter import Meter
from fxflops.program import Program, backward_rule
from fxflops.routing import RoutingProbes

ON_MISS = ("recapture", "raise")


class Instrumented(torch.nn.Module):
    """The model behind ``fxflops.instrument``; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        dims: dict[str, dict[int, str]] | None,
        segments: dict[str, str] | None,
        per_segment: dict[str, str] | None,
        strict_metadata: bool,
        backward: bool | str,
        on_miss: str,
        strict: bool,
        max_programs: int,
        meter: Meter | None,
        measure_routing: bool = False,
    ) -> None:
        if on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {ON_MISS}, not {on_miss!r}")
        super().__init__()
        # Share the model's registries (not a child module): state_dict keys stay the model's.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self._modules = model._modules
        self.training = model.training
        object.__setattr__(self, "model", model)
        self.dims = dims
        self.segments = segments
        self.per_segment = per_segment
        self.backward = backward_rule(backward)
        self.strict_metadata = strict_metadata
        self.on_miss = on_miss
        self.strict = strict
        self.max_programs = max_programs
        self.adapter = adapter_for(model)
        self.routing = RoutingProbes(model) if measure_routing else None
        self.programs: list[Program] = []
        self.flops = meter if meter is not None else Meter()
        self.captures = 0
        self._warned: set[str] = set()
        # forward keeps the model's signature: frameworks read it (the HF Trainer keeps only the
        # dataset columns that are forward parameters, and finds label names there)
        self.forward = types.MethodType(_with_signature(type(self).forward, model.forward), self)
        self._failed: dict[tuple, str] = {}

    @property
    def program(self) -> Program | None:
        """The first captured program (``None`` before the first call)."""
        return self.programs[0] if self.programs else None

    def train(self, mode: bool = True) -> Instrumented:
        self.model.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "model"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._prepare(args, kwargs)
        try:  # found (or captured) before the model runs, so a first call's routing is measured too
            found = self._program_for(args, kwargs)
        except FxFlopsError as exc:
            if self.strict or (self.on_miss == "raise" and isinstance(exc, GuardError)):
                raise
            self.flops.uncounted += 1
            self._warn_once(str(exc))
            found = None
        if self.routing is not None:
            self.routing.take()  # measurements of an earlier call that was not counted
        out = self.model(*args, **kwargs)
        if found is not None:
            training = self.backward != "none" and torch.is_grad_enabled() and _requires_grad(out)
            self.flops.add(found[0], self._monomials(*found), training)
        return out

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call with the metadata the model family derives added (``capture/adapters.py``): the
        model runs it (and skips deriving it), the program binds it. A failure leaves the call as is."""
        try:
            return self.adapter.prepare(args, kwargs)
        except Exception as exc:  # the model's own code will raise it again, or the count will fail open
            if self.strict:
                raise
            self._warn_once(f"{type(self.model).__name__}: could not derive metadata: {type(exc).__name__}: {exc}")
            return args, kwargs

    def _count(self, args: tuple, kwargs: dict, training: bool = False) -> None:
        """Count one (prepared) call without running the model."""
        program, values = self._program_for(args, kwargs)
        self.flops.add(program, self._monomials(program, values), training)

    def _program_for(self, args: tuple, kwargs: dict) -> tuple[Program, tuple[int, ...]]:
        """The program whose guards this call meets, and its symbol values; captures a new one when
        none does (``on_miss``); raises FxFlopsError when it cannot."""
        miss = "no program captured yet"
        for program in self.programs:
            try:
                values = program.binder.values(args, kwargs)
            except InputError as exc:
                miss = str(exc)
                continue
            if program.within_guards(*values):
                return program, values
            miss = program.explain_guard_failure(values)
        if self.programs and self.on_miss == "raise":
            raise GuardError(f"{type(self.model).__name__}: {miss}")
        if len(self.programs) >= self.max_programs:
            raise GuardError(
                f"{type(self.model).__name__}: {miss}; already {len(self.programs)} programs "
                f"(max_programs={self.max_programs}), not capturing another"
            )
        key = _shape_key(args, kwargs)
        if key in self._failed:
            raise CaptureError(self._failed[key])
        # a program with a backward is captured with grad enabled even when this call is a no_grad
        # forward (an evaluation before training): later training calls need its backward graph
        grad = torch.enable_grad() if self.backward == "traced" else contextlib.nullcontext()
        started = time.perf_counter()
        probes = self.routing.paused() if self.routing is not None else contextlib.nullcontext()
        try:
            with grad, probes:
                captured = capture(
                    self.model,
                    args,
                    kwargs,
                    self.dims,
                    allow_pins=bool(self.programs),
                    per_segment=self.per_segment,
                    backward=self.backward == "traced",
                    adapter=self.adapter,
                )
        except CaptureError as exc:
            self._failed[key] = str(exc)  # do not re-trace the same shapes on every call
            raise
        program = Program.from_capture(captured, self.model, self.segments, self.strict_metadata, self.backward)
        program.prepare = self.adapter.prepare
        self.flops.exclude_time(time.perf_counter() - started)  # capture time is not training time
        self.captures += 1
        self.programs.append(program)
        if self.routing is not None:
            self.routing.watch(program.experts)
        return program, program.binder.values(args, kwargs)

    def _monomials(self, program: Program, values: tuple[int, ...]) -> tuple:
        """The call's monomials, with what the routing probes measured for MoE programs."""
        monomials = program.monomials(*values)
        if program.experts and self.routing is not None:
            return program.with_routing(monomials, self.routing.take())
        return monomials

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"fxflops: call not counted: {message}", stacklevel=3)


def _with_signature(method: Any, model_forward: Any) -> Any:
    """A copy of ``method`` (``self, *args, **kwargs``) whose signature is ``self`` + the model's."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    signature = inspect.signature(model_forward)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    forward.__doc__ = getattr(model_forward, "__doc__", None)
    return forward


def _requires_grad(out: Any) -> bool:
    """True if any tensor in the output requires grad (so a backward can follow this forward)."""
    if isinstance(out, torch.Tensor):
        return out.requires_grad
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out))


def _shape_key(args: tuple, kwargs: dict) -> tuple:
    """Every tensor's shape and every other argument's type, to recognise a repeated failing call."""
    def describe(x: Any) -> Any:
        return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__

    return tuple(map(describe, args)) + tuple((k, describe(v)) for k, v in kwargs.items())


def instrument(
    model: torch.nn.Module,
    *,
    dims: dict[str, dict[int, str]] | None = None,
    segments: dict[str, str] | None = None,
    per_segment: dict[str, str] | None = None,
    strict_metadata: bool = False,
    backward: bool | str = False,
    on_miss: str = "recapture",
    strict: bool = False,
    max_programs: int = 8,
    meter: Meter | None = None,
    measure_routing: bool = False,
) -> Instrumented:
    """Wrap ``model`` so every call adds its FLOPs to ``wrapper.flops`` (see module docstring).

    ``dims``, ``segments``, ``per_segment``, ``strict_metadata`` and ``backward`` as for
    :func:`fxflops.trace` (``dims=None``: every input dim free unless the code pins it; segment
    families found automatically). With ``backward``, a call made with grad enabled whose output
    requires grad counts its backward (and recompute) too, on the assumption that a backward from its
    output follows; a forward under ``torch.no_grad()`` counts the forward only.

    ``meter`` shares one Meter between several wrappers: the pipeline stages or virtual-pipeline chunks
    a rank runs, each instrumented on its own, count every layer once however the schedule interleaves
    their microbatches.

    ``measure_routing`` wraps the expert modules of mixture-of-experts programs so that each call also
    measures the FLOPs its dispatch really computed (``fxflops/routing.py``), which the ``moe="actual"``
    convention reports; without it only ``moe="model"`` (top_k × tokens) is available.
    """
    return Instrumented(
        model, dims, segments, per_segment, strict_metadata, backward, on_miss, strict, max_programs, meter,
        measure_routing,
    )
