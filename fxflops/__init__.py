"""fxflops: exact FLOPs of PyTorch models from their own traced graph.

Public API: :func:`trace` (model -> :class:`Program`), :func:`instrument` (a counting wrapper with a
:class:`Meter`), :mod:`fxflops.rules` (the op -> FLOPs registry) and the errors in :mod:`fxflops.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxflops import conventions, ops, rules
from fxflops.capture.trace import capture as _capture
from fxflops.compile import CountingBackend
from fxflops.errors import (
    CaptureError,
    FxFlopsError,
    GuardError,
    InputError,
    MetadataError,
    PinnedSymbolError,
    UnboundSymbolError,
)
from fxflops.families import adapter_for
from fxflops.instrument import Instrumented, instrument
from fxflops.meter import Meter
from fxflops.conventions import Convention
from fxflops.program import Program, Term, Unsupported, backward_rule
from fxflops.rules import overlaid as _overlaid
from fxflops.situation import mode_key
from fxflops.verify import Verdict, verify


def trace(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dims: dict[str, dict[int, str]] | None = None,
    segments: dict[str, str] | None = None,
    per_segment: dict[str, str] | None = None,
    strict_metadata: bool = False,
    backward: bool | str = False,
    rules: Mapping[Any, Any] | None = None,
) -> Program:
    """Trace ``model(*args, **kwargs)`` once with symbolic sizes and return its FLOPs :class:`Program`.

    ``dims`` names the free symbols by forward-argument name and dimension, e.g.
    ``{"input_ids": {1: "seq"}, "pixel_values": {0: "patches"}}``; one name on two inputs is one
    symbol; every other dim is static. ``dims=None`` makes every dim of every tensor input free unless
    the model's code pins it, named ``<argument>_<dim>``; where the example's size-1 dims must broadcast
    (a ``(4, 1)`` bias, a ``(b, 1, 1, s)`` mask) they stay 1 (a call with another size there is
    another program). With explicit ``dims``, a symbol the code pins raises
    :class:`PinnedSymbolError` naming the line.

    Segment families (packed sequences cut by ``cu_seqlens``, frames from ``image_grid_thw``) are found
    automatically where offsets reach a varlen attention op; their power sums ``<family>_p<k>`` are
    symbols. ``segments`` names them by the input they come from, e.g.
    ``{"cu_seqlens": "text", "image_grid_thw": "frames"}``. ``per_segment`` names modules whose work is
    per segment but whose code cannot be traced over a whole batch (a Python loop over
    ``lengths.tolist()``), with the forward argument holding their offsets, e.g.
    ``{"visual.blocks.*.attn": "cu_seqlens"}``: each is traced once on one segment of length ``s`` and
    billed Σₖ cₖ·pₖ. ``strict_metadata`` also validates metadata on accelerators (a host sync); metadata
    on the CPU is always validated.

    ``backward=True`` (or ``"traced"``) captures the joint forward+backward graph: terms are tagged
    ``fwd``, ``bwd`` or ``recompute`` (activation checkpointing) and ``total(phase=...)`` selects them;
    frozen parameters and inputs without grad change the backward exactly as autograd does.
    ``backward="2x"`` adds twice each forward term instead (the rule formula-based tools use).

    ``rules`` adds FLOPs rules for this trace only, ``{op: rule}`` (a function as for
    :func:`fxflops.rules.register`, or a :class:`fxflops.rules.Entry` for segments, causal or kind),
    over the registry, which stays as it is.

    A Hugging Face ``transformers`` model is captured through its adapter
    (:mod:`fxflops.integrations.transformers`): metadata its forward would derive with loops is derived
    from the batch, its vision attention is lifted per segment, and its dims get readable names.
    """
    if not isinstance(args, tuple):
        args = (args,)
    rule = backward_rule(backward)
    adapter = adapter_for(model)
    args, kwargs = adapter.prepare(args, kwargs or {})
    modes = mode_key()
    with _overlaid(rules):  # checks the rules before the capture; the analysis uses them
        captured = _capture(model, args, kwargs, dims, per_segment=per_segment, backward=rule == "traced", adapter=adapter)
        program = Program.from_capture(captured, model, segments, strict_metadata, rule)
    program.prepare = adapter.prepare
    program.situation = (program.call_keys(args, kwargs), modes)
    return program


def backend(
    inner: str | Any = "inductor",
    *,
    model: torch.nn.Module | None = None,
    backward: bool = True,
    strict: bool = False,
) -> CountingBackend:
    """A ``torch.compile`` backend counting every compiled graph's FLOPs into ``.flops`` (a Meter),
    wrapping the registered backend ``inner`` whose output it leaves unchanged; see
    :mod:`fxflops.compile`. Give the compiled ``model`` so that graphs compiled from a
    submodule's frame (after a graph break) are attributed to that submodule's path."""
    return CountingBackend(inner, backward, strict, model)


__all__ = [
    "CaptureError",
    "Convention",
    "Verdict",
    "conventions",
    "verify",
    "FxFlopsError",
    "GuardError",
    "InputError",
    "Instrumented",
    "Meter",
    "MetadataError",
    "PinnedSymbolError",
    "Program",
    "Term",
    "UnboundSymbolError",
    "Unsupported",
    "backend",
    "instrument",
    "ops",
    "rules",
    "trace",
]
