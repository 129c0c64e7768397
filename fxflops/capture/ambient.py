"""A capture runs on a clean slate in its thread: the user's autograd hooks and modes never see it.

A wrapper may be called inside the user's own contexts: a non-reentrant ``torch.utils.checkpoint``
around the call (its saved-tensor hooks pack what the forward saves; unpacking them in the backward
re-runs the user's forward, the wrapper again), ``save_on_cpu`` (activation offloading), a
``FlopCounterMode`` or a logging ``TorchDispatchMode``, a ``TorchFunctionMode``. A capture made
under them would be seen by them: the traced backward would unpack through the user's checkpoint
hook and run the user's real recompute (which re-enters the wrapper while its capture holds the
wrapper's lock: a deadlock), the user's FlopCounterMode would count the trace's symbolic ops (its
total a SymInt), a logging mode would record ops that never ran, a pack hook would count packs twice.

:func:`clean_slate` takes them off the calling thread for the block and puts them back exactly as
they were, also when the block raises:

- the saved-tensor default hooks (``torch.autograd.graph.saved_tensors_hooks`` and what builds on
  it), and their disabled state (``disable_saved_tensors_hooks``);
- every ``TorchDispatchMode`` (the user's, and infrastructure modes such as an outer fake mode);
- every ``TorchFunctionMode`` except torch's default-device context (``torch.set_default_device``,
  ``with torch.device(...)``): where the model's code creates its tensors is part of the call.

Grad mode, autocast and the other global settings a call is matched by (``fxflops/situation.py``)
stay as they are: the trace is of the call as made.

Context variables (:func:`flags_context`): a capture runs in a context of its own holding only the
caller's context variables whose values are flags, numbers or strings (``USE_FUSED.get()`` in model
code traces as the call runs; ``situation_code.ContextValue`` guards it); the others are unset there
(transformers' output collectors of a running call: lists its hooks append to, which must never
receive the trace's fake tensors). Code reading attributes of such an object (``CFG.get().deep``)
traces its default: a call with another object set is measured (``situation_code.InContext``).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from typing import Any

import torch
import torch.overrides as overrides
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _disable_current_modes

_autograd = torch._C._autograd


@contextlib.contextmanager
def _without_saved_tensor_hooks() -> Iterator[None]:
    stack = []
    while (top := _autograd._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        _autograd._pop_saved_tensors_default_hooks()
    disabled = _autograd._saved_tensors_hooks_get_disabled_error_message()
    if disabled is not None:
        _autograd._saved_tensors_hooks_enable()
    try:
        yield
    finally:
        while _autograd._top_saved_tensors_default_hooks(True) is not None:  # left by a failing block
            _autograd._pop_saved_tensors_default_hooks()
        for pack, unpack in reversed(stack):
            _autograd._push_saved_tensors_default_hooks(pack, unpack)
        if disabled is not None:
            _autograd._saved_tensors_hooks_disable(disabled, False)


@contextlib.contextmanager
def _only_device_function_modes() -> Iterator[None]:
    stack = overrides._get_current_function_mode_stack()
    for _ in stack:
        overrides._pop_mode()
    for mode in stack:
        if isinstance(mode, DeviceContext):
            overrides._push_mode(mode)
    try:
        yield
    finally:
        for _ in overrides._get_current_function_mode_stack():
            overrides._pop_mode()
        for mode in stack:
            overrides._push_mode(mode)


@contextlib.contextmanager
def clean_slate() -> Iterator[None]:
    """The block runs without the user's saved-tensor hooks, dispatch modes and function modes
    (but the default device), which are put back afterwards (see the module docstring)."""
    with _without_saved_tensor_hooks(), _disable_current_modes(), _only_device_function_modes():
        yield


CONTEXT_FLAGS = (bool, int, float, str, type(None), enum.Enum)  # context variable values a capture sees


def traced_context_value(value: Any) -> bool:
    """Whether a capture sees a context variable holding ``value`` (else it is unset there)."""
    return isinstance(value, CONTEXT_FLAGS)


def flags_context() -> contextvars.Context:
    """A new context holding the caller's context variables whose values a capture sees."""
    kept = [(var, value) for var, value in contextvars.copy_context().items() if traced_context_value(value)]
    context = contextvars.Context()
    context.run(lambda: [var.set(value) for var, value in kept])
    return context
