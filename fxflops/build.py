"""From a model and one call to its :class:`~fxflops.program.Program`: the one sequence that
:func:`fxflops.trace` and :class:`~fxflops.instrument.Instrumented` both run.

1. the model family's adapter (``fxflops/adapters/``) prepares the call (metadata the model would
   derive with loops is derived from the batch);
2. ``capture`` traces it with symbolic sizes (``fxflops/capture/``);
3. the analysis applies the FLOPs rules to every node and the program compiles the polynomials
   (``fxflops/analysis/``, ``fxflops/program.py``), under the per-use rules if any;
4. the program is tagged with the situation it serves: the call's key and the grad/autocast modes
   (``fxflops/call_keys.py``, ``fxflops/situation.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxflops.adapters import Adapter, adapter_for
from fxflops.capture.ambient import clean_slate
from fxflops.capture.trace import capture
from fxflops.program import Program, backward_rule
from fxflops.rules import overlaid
from fxflops.rules.work import does_floating_work
from fxflops.situation import mode_key


def build_program(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    adapter: Adapter,
    *,
    dims: dict[str, dict[int, str]] | None = None,
    per_segment: dict[str, str] | None = None,
    segments: dict[str, str] | None = None,
    strict_metadata: bool = False,
    backward: str = "none",
    allow_pins: bool = False,
    rules: Mapping[Any, Any] | None = None,
    situation: tuple | None = None,
    roots: tuple[int, ...] | None = None,
) -> Program:
    """The program of ``model(*args, **kwargs)``, a call ``adapter`` has already prepared (steps 2–4
    of the module docstring). ``backward`` is a backward rule (``program.BACKWARD_RULES``):
    ``"traced"`` captures the joint forward+backward graph. ``situation`` is the call's (call key,
    mode key) when the caller has it; otherwise it is taken from this call and the current modes.
    ``roots``: the output tensors (by position) a traced backward starts from (default: the loss, or
    every floating output)."""
    modes = mode_key()
    # without the user's saved-tensor hooks and modes around the call: they never see the capture's
    # fakes, nor the analysis of its graph (capture/ambient.py); checks the rules before the capture
    with clean_slate(), overlaid(rules):
        captured = capture(
            model, args, kwargs, dims, allow_pins=allow_pins, per_segment=per_segment,
            backward=backward == "traced", adapter=adapter, roots=roots, floating_work=does_floating_work,
        )
        program = Program.from_capture(captured, model, segments, strict_metadata, backward, prepare=adapter.prepare)
    program.situation = situation if situation is not None else (program.call_keys(args, kwargs), modes)
    return program


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
    :class:`PinnedSymbolError` naming the line. A Python int argument named with a string,
    ``{"keep": "keep"}``, is traced as that symbol instead of being part of the call's identity (a
    length that changes on every call then needs no new program); ``dims`` naming only such
    arguments leaves every tensor dim free as ``dims=None`` does.

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
    (:mod:`fxflops.adapters.transformers`): metadata its forward would derive with loops is derived
    from the batch, its vision attention is lifted per segment, and its dims get readable names.
    """
    if not isinstance(args, tuple):
        args = (args,)
    adapter = adapter_for(model)
    args, kwargs = adapter.prepare(args, kwargs or {})
    return build_program(
        model, args, kwargs, adapter, dims=dims, per_segment=per_segment, segments=segments,
        strict_metadata=strict_metadata, backward=backward_rule(backward), rules=rules,
    )
