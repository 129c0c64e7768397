"""The capture scope: one capture at a time in the process, and patches only the capturing thread sees.

A capture changes process-wide things for its duration: ``torch.split`` keeps per-image pieces packed
(``capture/pieces.py``), ``Tensor.contiguous`` always copies (``capture/trace.py``), checkpointing's
recompute callables are tagged (``capture/phases.py``), ``nn.Module`` attribute reads are recorded
(``capture/reads.py``). Another thread running a model meanwhile must see none of it, and two threads
capturing at once must not install and remove each other's patches.

- :func:`capture_scope` holds a process-wide re-entrant lock for the whole capture (a nested capture,
  such as a lifted module's one-segment trace, re-enters it) and marks the current thread as
  capturing.
- :func:`patched` replaces ``owner.name`` by a dispatcher that calls the replacement in a capturing
  thread and the original everywhere else, and puts the original back when the block ends. A patch
  that is already installed (a nested capture) is not installed twice.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

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
            yield
        finally:
            _local.depth -= 1


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

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if capturing():
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(dispatch, _MARK, original)
    dispatch.__name__ = getattr(original, "__name__", name)
    dispatch.__doc__ = getattr(original, "__doc__", None)
    setattr(owner, name, staticmethod(dispatch) if static else dispatch)
    try:
        yield original
    finally:
        if raw is None:
            delattr(owner, name)
        else:
            setattr(owner, name, raw)
