"""The fake tensor mode of a trace, bound to the thread that traces.

A model may hand the call's tensors to other threads (``pool.submit(self.branch, x)`` in its
forward). Under a trace those are fake tensors: torch's ``FakeTensor.__torch_dispatch__`` then enters
the trace's mode on the worker thread, concurrently with the tracing thread. That work is not in the
graph (the tracer's modes are the tracing thread's), and the mode's per-thread state is left
inconsistent: torch later aborts the process ("trying to set the current FakeTensorMode, but one
already exists"). :class:`ThreadBoundFakeMode` refuses to be entered from any other thread, before
it changes anything there, except by autograd's engine running a backward the trace started (its
device threads run the nodes of CUDA tensors, fake ones too, with the tracing thread's modes and
waiting for it: inside a graph task); the worker's op raises :class:`~fxflops.errors.OtherThreadError`, and
:meth:`ThreadBoundFakeMode.check` raises it in the tracing thread too when the model's code caught
the worker's error (a trace missing that work must not become a program).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxflops.errors import OtherThreadError


class ThreadBoundFakeMode(FakeTensorMode):
    """A ``FakeTensorMode`` entered only by the thread that made it (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.owner = threading.get_ident()
        self.other_thread: str | None = None  # the name of a thread that tried to compute with the fakes

    def __enter__(self) -> ThreadBoundFakeMode:
        if threading.get_ident() != self.owner and torch._C._current_graph_task_id() == -1:
            self.other_thread = threading.current_thread().name
            raise OtherThreadError(self._message())
        return super().__enter__()

    def check(self) -> None:
        """Raise, in the tracing thread, when another thread tried to compute with the fakes."""
        if self.other_thread is not None:
            raise OtherThreadError(self._message())

    def _message(self) -> str:
        return (
            f"the model's code computes with the call's tensors on another thread ({self.other_thread}): "
            "neither a trace nor a measurement sees that work (both are per thread), so such calls are not counted"
        )
