"""A capture leaves the user's objects as they were, also while it runs.

The fake trace runs the model's own Python code, which may write to the objects it is given: a
key-value cache appends the step's keys and values (fake ones, in a trace), a model keeps a tensor it
computed (``self.rope_deltas = ...``), a layer counts its calls; and the capture itself puts fake
parameters into the modules (``functional_call``), stand-in ``forward`` methods on lifted and
repeated layers, and settings into configs. None of that may reach the user's objects: fake tensors
would reach the next real forward, counters would count twice, and another thread running the same
model meanwhile (an evaluation thread) would compute with fake weights.

- :func:`twin_of` gives each trace its own copy of the model's module tree: every module a new object
  of its class whose attributes are the original's, its containers (``_parameters``, ``_buffers``,
  ``_modules``, hook dicts, lists) copied one level and pointing to the twins of the tree's modules,
  sharing every tensor; the plain objects the modules hold (configs, two levels deep,
  ``capture/reads.py``) are copied the same way. The trace writes only to the twin.
- :func:`isolated_call` gives the trace its own copy of every argument that is not a tensor, a plain
  value or a container of those (a cache object, a config passed in): a deep copy that shares the
  tensors, modules and functions inside it. An object that cannot be copied is passed as it is and
  its attributes are restored afterwards, as for modules.
- :func:`preserving_state` restores, after the block, the attributes of every module of the model and
  of the plain objects they hold, and the contents of their list, dict and set attributes, by
  identity: for what the twin does not own (an original module reached through a closure, such as a
  compiled submodule's ``forward``; an argument that could not be copied).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxflops.capture.reads import held_objects

_MISSING = object()
_CONTAINERS = (list, dict, set)
_PLAIN_CONTAINERS = frozenset({list, dict, set, collections.OrderedDict})  # whose .copy() keeps their type


def _items(value: Any) -> list:
    return list(value.items()) if isinstance(value, dict) else list(value)


def _unchanged(now: list, before: list) -> bool:
    """Same items by identity (dict items: equal keys, identical values)."""
    if len(now) != len(before):
        return False
    for a, b in zip(now, before):
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2:
            if a[0] != b[0] or a[1] is not b[1]:
                return False
        elif a is not b:
            return False
    return True


def _snapshot(obj: Any) -> tuple[dict, dict, dict]:
    state = vars(obj)
    contents = {key: _items(value) for key, value in state.items() if isinstance(value, _CONTAINERS)}
    return state, dict(state), contents


def _restore(state: dict, before: dict, contents: dict) -> None:
    """Put ``state`` back as ``before``: attributes by identity, container contents in place."""
    for key in [k for k in state if k not in before]:
        del state[key]
    for key, value in before.items():
        if state.get(key, _MISSING) is not value:
            state[key] = value
    for key, items in contents.items():
        value = before[key]
        if not _unchanged(_items(value), items):
            value.clear()
            if isinstance(value, list):
                value.extend(items)
            else:
                value.update(items)


@contextlib.contextmanager
def preserving_state(model: torch.nn.Module, extra: list[Any] = ()) -> Iterator[None]:
    """The model's modules and held objects (and ``extra`` objects) exactly as before, after the block."""
    objects = {id(m): m for m in model.modules()} | held_objects(model) | {id(o): o for o in extra}
    saved = [_snapshot(obj) for obj in objects.values() if hasattr(obj, "__dict__")]
    try:
        yield
    finally:
        for state, before, contents in saved:
            _restore(state, before, contents)


@dataclass(frozen=True)
class Twin:
    """A model's module tree copied for one trace (see the module docstring)."""

    model: torch.nn.Module
    originals: dict[int, Any]  # id(copy) -> the user's object it copies


def twin_of(model: torch.nn.Module) -> Twin:
    """A copy of ``model``'s modules and held objects for one trace to run on and write to."""
    objects = {id(m): m for m in model.modules()} | held_objects(model)
    copies = {key: twin for key, obj in objects.items() if (twin := _blank(obj)) is not None}
    for key, twin in copies.items():
        vars(twin).update({name: _owned(value, copies) for name, value in vars(objects[key]).items()})
    return Twin(copies.get(id(model), model), {id(twin): objects[key] for key, twin in copies.items()})


def _blank(obj: Any) -> Any:
    """A new object of ``obj``'s class with an empty ``__dict__`` (its ``__init__`` not run), or
    ``None`` when the class keeps state outside ``__dict__`` or cannot be made so (then shared)."""
    if any(vars(cls).get("__slots__") for cls in type(obj).__mro__):
        return None
    try:
        return object.__new__(type(obj))
    except TypeError:
        return None


def _owned(value: Any, copies: dict[int, Any]) -> Any:
    """``value`` as the twin holds it: a copied object's copy, a method rebound to the copy, a
    container copied one level with copied objects in it; anything else shared. A wrapper fxflops
    installed on a module (``fxflops_wraps``: a generation route, a routing probe) is not the
    model's: the twin holds what it wraps."""
    while hasattr(value, "fxflops_wraps"):
        value = value.fxflops_wraps
    if id(value) in copies:
        return copies[id(value)]
    if isinstance(value, types.MethodType) and id(value.__self__) in copies:
        return types.MethodType(value.__func__, copies[id(value.__self__)])
    if type(value) is tuple:
        return tuple(copies.get(id(item), item) for item in value)
    if not isinstance(value, _CONTAINERS):
        return value
    try:
        own = value.copy() if type(value) in _PLAIN_CONTAINERS else copy.copy(value)
    except Exception:  # noqa: BLE001 - a container that cannot be copied: shared, restored by preserving_state
        return value
    if isinstance(own, dict):
        own.update({key: copies[id(item)] for key, item in value.items() if id(item) in copies})
    elif isinstance(own, list):
        own[:] = [copies.get(id(item), item) for item in value]
    return own


_PLAIN = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size, type)


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN)


def _shared(obj: Any) -> dict[int, Any]:
    """A deepcopy memo keeping the tensors, modules and functions reachable from ``obj`` shared."""
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [obj]
    while stack and len(seen) < 10_000:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (torch.Tensor, torch.nn.Module)) or callable(value) and not hasattr(value, "__dict__"):
            memo[id(value)] = value
            continue
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif hasattr(value, "__dict__"):
            stack.extend(vars(value).values())
    return memo


def isolated_call(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[Any]]:
    """``(args, kwargs)`` with every opaque argument replaced by a copy sharing its tensors; also the
    objects that could not be copied (to be restored with :func:`preserving_state`)."""
    uncopied: list[Any] = []

    def own(value: Any) -> Any:
        if _plain(value) or not hasattr(value, "__dict__") or isinstance(value, torch.nn.Module) or callable(value):
            return value
        try:
            return copy.deepcopy(value, _shared(value))
        except Exception:  # noqa: BLE001 - an object deepcopy cannot handle: restored afterwards instead
            uncopied.append(value)
            return value

    args, kwargs = pytree.tree_map(own, (args, kwargs))
    return args, kwargs, uncopied
