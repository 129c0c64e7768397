"""The tensors of a model's output: what a traced backward starts from, and what says that one follows.

``torch.utils._pytree`` knows tuples, lists, dicts, named tuples and the containers libraries
register (Hugging Face's ``ModelOutput``); any other object is one opaque leaf to it. A model may
return its results in a plain ``@dataclass`` or an object holding them as attributes, and a backward
from ``out.logits`` follows all the same: seen as a leaf, the output would have no tensors, its
backward would go uncounted without a word. :func:`output_tensors` also looks inside such leaves.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import types
from typing import Any

import torch
import torch.utils._pytree as pytree

MAX_DEPTH = 8  # objects inside objects looked into
_SKIPPED = (  # hold no output: modules, classes, text, functions (a closure's cells are not the output's)
    torch.nn.Module, type, str, bytes, types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial,
)


def output_tensors(out: Any, hidden: list[str] | None = None) -> list[torch.Tensor]:
    """Every tensor of ``out``, in a fixed order: pytree's leaves, and inside a leaf pytree does not
    know (a dataclass, a dict or list subclass, a plain object), what it holds (:func:`_fields`,
    recursively, :data:`MAX_DEPTH` deep). ``hidden`` gets why tensors of ``out`` may be out of
    sight: an iterator (a generator), whose tensors exist only once it is consumed, or objects nested
    deeper than :data:`MAX_DEPTH` (which of them a backward starts from cannot be seen when the call
    returns)."""
    found: list[torch.Tensor] = []
    _collect(out, found, 0, set(), hidden)
    return found


def loss_of(out: Any) -> Any:
    """The ``loss`` an output carries (a Mapping's key, a dataclass's field), or None."""
    return _field(out, "loss")


def backward_roots(out: Any, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What training differentiates: the ``loss`` of an output that has one (a Hugging Face
    ``ModelOutput``, a dict), as ``out.loss.backward()`` does; else every floating-point output
    (``loss = sum of the outputs``) but those of the key-value cache it returns (``cache``, formerly
    ``past_key_values``: state for later calls, which no loss reads; a sliding window's cache keeps
    a slice of the keys that a loss from the logits never differentiates). Other outputs of a model
    with a loss (LLaVA
    returns the vision tower's last hidden state, which its projector does not read) get no gradient
    in training."""
    loss = loss_of(out)
    if isinstance(loss, torch.Tensor) and loss.dtype.is_floating_point:
        return [loss]
    cache = {id(t) for name in _CACHE_FIELDS for t in output_tensors(_field(out, name))}
    return [x for x in outputs if x.dtype.is_floating_point and id(x) not in cache]


_CACHE_FIELDS = ("cache", "past_key_values", "cache_params")  # Hugging Face's names of an output's cache, new and old


def _field(out: Any, name: str) -> Any:
    """A Mapping's entry or a dataclass's field ``name`` of an output, or None (read only where it
    is one: a renamed field's old name warns in transformers)."""
    if isinstance(out, collections.abc.Mapping):
        return out[name] if name in out.keys() else None
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return getattr(out, name) if name in {f.name for f in dataclasses.fields(out)} else None
    return None


def _collect(value: Any, found: list[torch.Tensor], depth: int, seen: set[int], hidden: list[str] | None) -> None:
    """Add the tensors of ``value`` to ``found``; why some cannot be seen to ``hidden``."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _is_iterator(leaf):
            if hidden is not None:
                hidden.append("the output holds an iterator")
        elif id(leaf) not in seen and not isinstance(leaf, _SKIPPED):
            seen.add(id(leaf))  # an object holding itself, or held twice: looked into once
            fields = _fields(leaf)
            if depth < MAX_DEPTH:
                for field in fields:
                    _collect(field, found, depth + 1, seen, hidden)
            elif fields and hidden is not None:
                hidden.append(f"the output holds objects nested more than {MAX_DEPTH} deep")


def _fields(leaf: Any) -> list[Any]:
    """What an object pytree does not know holds: a dataclass's field values; a mapping's values
    and a sequence's or set's items (a dict or list subclass); a plain object's attributes and
    slots (a callable one's too)."""
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
    if isinstance(leaf, collections.abc.Mapping):
        return list(leaf.values())
    if isinstance(leaf, (collections.abc.Sequence, collections.abc.Set)):
        return list(leaf)
    state = getattr(leaf, "__dict__", None)
    values = list(state.values()) if isinstance(state, dict) else []
    slots = (name for cls in type(leaf).__mro__ for name in _slot_names(cls))
    return values + [getattr(leaf, name) for name in slots if name not in ("__dict__", "__weakref__") and hasattr(leaf, name)]


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = vars(cls).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _is_iterator(value: Any) -> bool:
    return isinstance(value, collections.abc.Iterator) and not isinstance(value, torch.Tensor)
