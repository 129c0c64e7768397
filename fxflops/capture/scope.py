"""The capture scope: one capture at a time in the process, and patches only the capturing thread sees.

A capture changes process-wide things for its duration: ``torch.split`` keeps per-image pieces packed
(``fxflops/adapters/pieces.py``), ``Tensor.contiguous`` always copies (``capture/trace.py``), checkpointing's
recompute callables are tagged (``capture/phases.py``), ``nn.Module`` attribute reads are recorded
(``capture/reads.py``). Another thread running a model meanwhile must see none of it, and two threads
capturing at once must not install and remove each other's patches.

- :func:`capture_scope` holds a process-wide re-entrant lock for the whole capture (a nested capture,
  such as a lifted module's one-segment trace, re-enters it) and marks the current thread as
  capturing.
- :func:`patched` replaces ``owner.name`` by a dispatcher that calls the replacement in a capturing
  thread and the original everywhere else, and puts the original back when the block ends. A patch
  that is already installed (a nested capture) is not installed twice.
- FX keeps "a symbolic trace is running" in one process-wide flag (``torch.fx._symbolic_trace``), which
  ``make_fx`` sets for the whole capture. A compiled module (``torch.compile``) called in another thread reads
  it and refuses to run ("FX to symbolically trace a dynamo-optimized function"). While a capture
  runs, the flag's readers answer for the calling thread (:func:`_fx_tracing_for_this_thread`: another
  thread's compiled module waits for the capture to end instead of raising or disturbing it), and
  compiled code reached by the capture itself runs as written (Dynamo inlines it instead of raising):
  a capture traces what a compiled module computes. The methods FX's tracer patches on
  ``nn.Module`` to record module calls are patched for the capturing thread only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx._symbolic_trace as _fx_trace

_LOCK = threading.RLock()
_local = threading.local()


def capturing() -> bool:
    """Whether this thread is inside a capture."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def capture_scope() -> Iterator[None]:
    """The block runs as a capture: alone in the process, with this thread's patches active."""
    with _LOCK:
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            if _local.depth == 1:
                with _fx_tracing_for_this_thread():
                    yield
            else:
                yield
        finally:
            _local.depth -= 1


def _fx_tracing_here() -> bool:
    """FX's tracing flag as the calling thread sees it while a capture runs: set only by the capture,
    so true only in the capturing thread. Another thread asking (a compiled module about to run,
    which would disturb the trace) waits for the capture to end, then sees no trace."""
    if capturing():
        return bool(_fx_trace._is_fx_tracing_flag)
    with _LOCK:  # held by the capturing thread for the whole capture
        return False


def _is_fx_tracing_per_thread() -> bool:  # the code of torch.fx's is_fx_tracing while a capture runs
    is_fx_tracing_warning()  # noqa: F821 - a global of torch.fx._symbolic_trace, where this code runs
    return __fxflops_fx_tracing_here__()  # noqa: F821 - installed there by _fx_tracing_for_this_thread


def _is_fx_symbolic_tracing_per_thread() -> bool:  # ... and of is_fx_symbolic_tracing
    return __fxflops_fx_tracing_here__() and not torch.compiler.is_compiling()  # noqa: F821


@contextlib.contextmanager
def _fx_tracing_for_this_thread() -> Iterator[None]:
    """For the block: FX's tracing-flag readers answer per thread, and Dynamo runs compiled code that
    a capture reaches as written. The readers' code is swapped, not the functions: Dynamo keeps a
    reference to ``is_fx_symbolic_tracing`` in every compiled wrapper it made."""
    import torch._dynamo.config as dynamo_config

    readers = {
        _fx_trace.is_fx_tracing: _is_fx_tracing_per_thread.__code__,
        _fx_trace.is_fx_symbolic_tracing: _is_fx_symbolic_tracing_per_thread.__code__,
    }
    originals = {reader: reader.__code__ for reader in readers}
    _fx_trace.__fxflops_fx_tracing_here__ = _fx_tracing_here
    for reader, code in readers.items():
        reader.__code__ = code
    try:
        with dynamo_config.patch(error_on_nested_fx_trace=False), _fx_method_patches_for_this_thread():
            yield
    finally:
        for reader, code in originals.items():
            reader.__code__ = code
        del _fx_trace.__fxflops_fx_tracing_here__


@contextlib.contextmanager
def _fx_method_patches_for_this_thread() -> Iterator[None]:
    """For the block: the methods FX's tracer patches while it traces (``nn.Module.__call__`` and
    ``__getattr__``, to record module calls) are patched for the capturing thread only; a module
    called in another thread runs as always (and is not recorded into the capture's graph)."""
    patch_method = _fx_trace._Patcher.patch_method

    def for_this_thread(patcher: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        orig_fn = getattr(cls, name)

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return new_fn(*args, **kwargs) if capturing() else orig_fn(*args, **kwargs)

        patch_method(patcher, cls, name, dispatch, deduplicate)

    _fx_trace._Patcher.patch_method = for_this_thread
    try:
        yield
    finally:
        _fx_trace._Patcher.patch_method = patch_method


_MARK = "__fxflops_patch__"


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """``owner.name`` is ``replacement`` for capturing threads while the block runs (other threads
    keep the original); yields the original, for the replacement to call. Static methods stay static."""
    raw = owner.__dict__.get(name) if isinstance(owner, type) else vars(owner).get(name)
    if getattr(raw, _MARK, None) is not None or getattr(getattr(raw, "__func__", None), _MARK, None) is not None:
        yield getattr(raw, _MARK, None) or getattr(raw.__func__, _MARK)  # a nested capture: already installed
        return
    static = isinstance(raw, staticmethod)
    original = getattr(owner, name) if not static else raw.__func__
    dispatch = _dispatching(original, replacement, name)
    setattr(owner, name, staticmethod(dispatch) if static else dispatch)
    try:
        yield original
    finally:
        if raw is None:
            delattr(owner, name)
        else:
            setattr(owner, name, raw)


@contextlib.contextmanager
def patched_cell(cell: Any, replacement: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """The same for the function a closure cell holds (the cache a decorator's wrapper calls)."""
    original = cell.cell_contents
    if getattr(original, _MARK, None) is not None:
        yield getattr(original, _MARK)
        return
    cell.cell_contents = _dispatching(original, replacement, "cell")
    try:
        yield original
    finally:
        cell.cell_contents = original


def _dispatching(original: Callable[..., Any], replacement: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A function calling ``replacement`` in capturing threads and ``original`` in the others."""

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if capturing():
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(dispatch, _MARK, original)
    dispatch.__name__ = getattr(original, "__name__", name)
    dispatch.__doc__ = getattr(original, "__doc__", None)
    return dispatch
