"""Distributed engines kept out of a capture: the trace sees what this rank computes, and the engine
is never run or changed by it.

The engines PyTorch ships wrap a model's computation in their own machinery. A fake trace must not
run it (FSDP2's lazy initialisation and all-gathers on fake tensors leave its parameter state broken
for the next real step), and must still see the arithmetic each rank does:

- **FSDP2** (``torch.distributed.fsdp.fully_shard``) keeps parameters as sharded DTensors and, in
  forward hooks, all-gathers them (and casts for mixed precision) before the module runs: a rank
  multiplies the full parameters with its own data. The capture gives each such parameter a fake of
  its unsharded shape (FSDP's ``FSDPParam._orig_size``: still the local shard along a tensor-parallel
  dim in 2-D parallelism).
- **Tensor parallelism on DTensor** (``parallelize_module`` with ``ColwiseParallel``,
  ``RowwiseParallel``, ...) keeps parameters as DTensors sharded over the TP mesh and redistributes
  inputs and outputs in forward hooks (``use_local_output``: the module's code runs on local tensors):
  a rank computes on its local shards. The capture gives such parameters their local shapes.
- **DDP** (``DistributedDataParallel``) prepares its reducer and syncs buffers around
  ``self.module(...)``: the capture calls the wrapped module directly.

- **Pipelining** (``torch.distributed.pipelining``): at its first step a ``PipelineStage`` infers the
  shapes it sends by running its module once on empty tensors (``_compute_outputs``, forward and
  backward). That is the schedule's bookkeeping, not a microbatch: :func:`not_a_microbatch` tells
  ``instrument()`` to run such calls uncounted.

- **torch.func transforms and forward-mode AD** (``torch.vmap(model)``, ``torch.func.grad``,
  ``jacrev``, ``jvp``, a ``forward_ad.dual_level``): the model's code sees per-sample tensors (vmap)
  or computes tangents besides its outputs, work that neither the call's sizes nor a trace of it
  describe. :func:`transform_around` names the transform; such calls are not counted, said.

- **torch.compile** wraps a module in an ``OptimizedModule`` that runs the original module's code
  compiled: :func:`traced_module` is that original module, which a capture traces (its submodule
  names are the model's own, without ``_orig_mod.``). Compiled code a capture reaches inside a model
  runs as written (``capture/scope.py``).

Engine hooks (forward hooks whose function comes from ``torch.distributed``) do nothing in the twin of
the module tree a capture traces (``capture/isolation.py``): the user's modules keep them, also for a
real step in another thread meanwhile.
Communication is not arithmetic and is not counted.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

from fxflops.capture.scope import patched

_ENGINE_PACKAGES = ("torch.distributed",)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


def _is_engine_hook(hook: Any) -> bool:
    """Whether a module hook belongs to a distributed engine (its function is torch.distributed's)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    function = getattr(hook, "__func__", hook)
    return getattr(function, "__module__", "").startswith(_ENGINE_PACKAGES)


def _does_nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def engines_left_alone(model: torch.nn.Module) -> Iterator[None]:
    """For the block (a capture of ``model``, a twin of the user's model: ``capture/isolation.py``,
    whose hook dicts are its own): the engines' forward hooks on its modules do nothing, and
    ``DistributedDataParallel`` runs its module directly."""
    for module in model.modules():
        for name in _HOOK_DICTS:
            hooks = vars(module).get(name)
            for key, hook in list(hooks.items()) if hooks else ():
                if _is_engine_hook(hook):
                    hooks[key] = _does_nothing
    with _ddp_runs_its_module():
        yield


@contextlib.contextmanager
def _ddp_runs_its_module() -> Iterator[None]:
    ddp = _ddp_class()
    if ddp is None:
        yield
        return
    with patched(ddp, "forward", lambda self, *args, **kwargs: self.module(*args, **kwargs)):
        yield


def _ddp_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def traced_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose code runs when ``model`` is called: through ``torch.compile``'s wrappers."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # no compiled module before Dynamo is loaded
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def compute_shapes(model: torch.nn.Module) -> dict[int, torch.Size]:
    """``{id(parameter): the shape this rank computes with}`` for the engines' sharded parameters:
    FSDP2's unsharded shape; a tensor-parallel DTensor's local shape (see the module docstring).
    Parameters not listed are used as they are."""
    if not torch.distributed.is_available():
        return {}
    from torch.distributed.tensor import DTensor

    shapes: dict[int, torch.Size] = {}
    for module in model.modules():
        state = _fsdp_state(module)
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for fsdp_param in group.fsdp_params:
                shapes[id(fsdp_param.sharded_param)] = torch.Size(fsdp_param._orig_size)
    for tensor in (*model.parameters(), *model.buffers()):
        if isinstance(tensor, DTensor) and id(tensor) not in shapes:
            shapes[id(tensor)] = tensor.to_local().shape
    return shapes


def _fsdp_state(module: torch.nn.Module) -> Any:
    getter = getattr(module, "_get_fsdp_state", None)
    if getter is None:
        return None
    try:
        return getter()
    except (AssertionError, RuntimeError, AttributeError):  # not (yet) an FSDP module with a state
        return None


_inference = threading.local()
_PIPELINING = "torch.distributed.pipelining.stage"


def transform_around() -> str | None:
    """The torch.func transform or forward-mode AD level the calling thread is inside, or None
    (two C-level reads)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "a torch.func transform (vmap, grad, jacrev, jvp)"
    if forward_ad._current_level >= 0:
        return "forward-mode AD (torch.autograd.forward_ad.dual_level)"
    return None


def not_a_microbatch() -> bool:
    """Whether this thread is inside a pipeline stage's shape inference (see the module docstring).
    The first call after ``torch.distributed.pipelining`` is imported marks its stages' inference."""
    if getattr(_inference, "depth", 0):
        return True
    if _marks["pipelining"] is None and _PIPELINING in sys.modules:
        _mark_pipeline_inference(sys.modules[_PIPELINING])
        return _inside_compute_outputs()  # marked only from now: this call may be inside one already
    return False


def _inside_compute_outputs() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_compute_outputs" and frame.f_globals.get("__name__") == _PIPELINING:
            return True
        frame = frame.f_back
    return False


_marks: dict[str, Any] = {"pipelining": None}


def _mark_pipeline_inference(stage_module: Any) -> None:
    """Every stage class's ``_compute_outputs`` (its shape inference) runs with the thread marked;
    the stages' own behaviour is unchanged."""
    stages = [c for c in vars(stage_module).values() if isinstance(c, type) and "_compute_outputs" in vars(c)]
    for stage in stages:
        original = vars(stage)["_compute_outputs"]
        if getattr(original, "fxflops_marked", False):
            continue

        def compute_outputs(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            _inference.depth = getattr(_inference, "depth", 0) + 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                _inference.depth -= 1

        functools.update_wrapper(compute_outputs, original)
        compute_outputs.fxflops_marked = True
        stage._compute_outputs = compute_outputs
    _marks["pipelining"] = bool(stages)
