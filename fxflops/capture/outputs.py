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
from typing import Any

import torch
import torch.utils._pytree as pytree

MAX_DEPTH = 4  # objects inside objects looked into
_SKIPPED = (torch.nn.Module, type, str, bytes)


def output_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of ``out``, in a fixed order: pytree's leaves, and inside a leaf that is a
    dataclass or a plain object, its fields / attributes (recursively, :data:`MAX_DEPTH` deep)."""
    found: list[torch.Tensor] = []
    _collect(out, found, 0)
    return found


def holds_iterator(out: Any) -> bool:
    """Whether ``out`` holds an iterator (a generator): its tensors exist only once it is consumed,
    so which of them a backward starts from cannot be seen when the call returns."""
    return any(_is_iterator(leaf) for leaf in pytree.tree_leaves(out))


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


def _collect(value: Any, found: list[torch.Tensor], depth: int) -> None:
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif depth < MAX_DEPTH and not isinstance(leaf, _SKIPPED) and not _is_iterator(leaf):
            fields = _fields(leaf)
            if fields is not None:
                for field in fields:
                    _collect(field, found, depth + 1)


def _fields(leaf: Any) -> list[Any] | None:
    """A dataclass's field values, or a plain object's attribute values; None for anything else."""
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
    state = getattr(leaf, "__dict__", None)
    if isinstance(state, dict) and not callable(leaf):
        return list(state.values())
    return None


def _is_iterator(value: Any) -> bool:
    return isinstance(value, collections.abc.Iterator) and not isinstance(value, torch.Tensor)
