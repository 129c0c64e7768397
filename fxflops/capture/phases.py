"""Phases of a joint forward+backward capture: ``fwd``, ``bwd`` and ``recompute``.

A joint capture runs the model, then ``torch.autograd.backward`` from its outputs (as
``loss.backward()`` does: gradients flow to every leaf that requires grad, parameters and inputs)
inside the same ``make_fx`` trace, so the graph holds the backward ops autograd really runs: frozen
parameters have no weight gradient, inputs without grad no input gradient. (``autograd.grad`` would
do, but reentrant checkpointing refuses it.) Each node is tagged through ``torch.fx.traceback`` node metadata:

* nodes recorded while the backward runs get ``meta["custom"]["fxflops_phase"] = "bwd"``, and the
  autograd sequence number (``meta["seq_nr"]``) of the forward op they differentiate, from torch's own
  stack-preservation hooks (the mechanism AOT autograd uses);
* forward code that activation checkpointing re-runs during the backward is tagged ``"recompute"``:
  the recomputation callables of ``torch.utils.checkpoint`` (non-reentrant, selective, and the
  reentrant ``CheckpointFunction``) are wrapped for the duration of the capture only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as checkpoint_module
from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks_from_tensors

from fxflops.capture.scope import patched

PHASE_KEY = "fxflops_phase"
_state = {"in_backward": False}


@contextlib.contextmanager
def own_phases() -> Iterator[None]:
    """A nested trace (a lifted module's one-segment trace, made while the outer trace may be in
    its backward or a recompute) tags its own nodes from ``fwd``, as a trace of its own."""
    outer = _state["in_backward"]
    _state["in_backward"] = False
    try:
        with fx_traceback.annotate({PHASE_KEY: "fwd"}):
            yield
    finally:
        _state["in_backward"] = outer


def phase_of(node: torch.fx.Node) -> str:
    """The phase a captured node ran in."""
    return node.meta.get("custom", {}).get(PHASE_KEY, "fwd")


def _recomputing(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def recompute(*args: Any, **kwargs: Any) -> Any:
        if not _state["in_backward"]:  # the reentrant checkpoint's first (real) forward
            return fn(*args, **kwargs)
        with fx_traceback.annotate({PHASE_KEY: "recompute"}):
            return fn(*args, **kwargs)

    return recompute


@contextlib.contextmanager
def tagging_recompute() -> Iterator[None]:
    """Wrap checkpointing's recomputation callables so their ops are tagged ``recompute`` (in the
    capturing thread only, ``capture/scope.py``). Selective checkpointing (``context_fn``) takes the
    capture's proxy mode for ``torch.compile`` and would save every op's output whatever its policy
    says (an empty recompute): in the capture it is told it is not compiling, so it saves and
    recomputes as the policy does in eager."""

    def init(self, recompute_fn, *args: Any, **kwargs: Any) -> None:
        frame_init(self, _recomputing(recompute_fn), *args, **kwargs)

    def forward(ctx, run_function, preserve_rng_state, *args):
        return reentrant_forward(ctx, _recomputing(run_function), preserve_rng_state, *args)

    def not_compiling(*args: Any) -> bool:  # selective checkpointing then follows its policy (see below)
        return False

    with patched(checkpoint_module._CheckpointFrame, "__init__", init) as frame_init, \
            patched(checkpoint_module.CheckpointFunction, "forward", forward) as reentrant_forward, \
            patched(checkpoint_module, "_is_compiling", not_compiling), \
            fx_traceback.preserve_node_meta():
        yield


def run_backward(outputs: list[torch.Tensor], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Backward from ``outputs`` (seeded with ones), every op tagged ``bwd``; returns the gradients
    accumulated into ``leaves`` (the capture's inputs: fresh fake leaves, and the SymInts of sizes an
    argument object holds, a cache's lengths, which have none)."""
    roots = [t for t in outputs if t.requires_grad]
    if not roots:
        return []
    setup_stacktrace_preservation_hooks_from_tensors(roots)
    outer, _state["in_backward"] = _state["in_backward"], True  # nested: a lifted module's own trace
    try:
        with fx_traceback.annotate({PHASE_KEY: "bwd"}):
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    finally:
        _state["in_backward"] = outer
    return [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.grad is not None]
