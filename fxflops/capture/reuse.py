"""Repeated layers traced once: a decoder stack's identical layers cost one layer's capture.

Symbolic tracing costs about a millisecond per op, so a 24-layer model spends most of its capture
re-tracing the same layer. During a capture, every child of an ``nn.ModuleList`` is wrapped: the
first call of each kind of layer runs for real (the *template*); a later layer whose call matches a
template's exactly runs as :func:`repeat_marker` nodes shaped like the template's outputs, and the
analysis bills it the template's terms under its own path (``analysis/lifted.py``).

In the graph (``capture/markers.py`` has the marker ops)::

    before:  h1 = layers.0(h0)   # its ops: q/k/v/o projections, attention, MLP, norms
             h2 = layers.1(h1)   # the same ops again
    after:   h1 = layers.0(h0)   # traced: the template
             h2 = fxflops.repeat_layer(h1, [B, S, D], float32, "layers.1")   # billed as layers.0's terms

"Matches exactly" is deliberately strict, because a wrong match would be a silently wrong count:

- the same class, and the same parameters and buffers (names, shapes, dtypes, ``requires_grad``:
  a frozen layer is its own kind);
- the same submodule tree (paths and classes) and the same instance attributes on the layer and
  every submodule, compared deeply (:func:`layer_attributes`): plain values by ``==``, containers
  item by item, held objects (a config) by their attributes, plain tensor attributes by shape,
  dtype, device and value (code may read them: ``range(int(self.n))``), modules held outside
  ``_modules`` (a Python list of blocks) by the same structure, functions by code, defaults and
  closure, hooks by their functions. Private attributes count too (``self._extra``). Gemma's sliding
  and full attention layers, a checkpointed layer, a differently sized layer, a layer that stores its
  own index are different kinds. Only a model family's adapter may name attributes to ignore:
  transformers layers' ``layer_idx`` only indexes caches (every index-dependent choice in
  transformers 5.x is made in ``__init__`` as an attribute or a submodule class). What cannot be
  compared (an object without attributes, a tensor without data) is equal only to itself: when in
  doubt a layer is traced, never billed as a copy;
- the same call: the same argument structure and non-tensor values, floating tensors of the same
  dtype, ``requires_grad`` and symbolic shape, and integer/bool tensors (offsets, masks, positions)
  that are the very same tensors as the template's — Qwen2.5-VL's window and full attention blocks,
  which get different offsets, are different kinds.

Only layers called once per capture (else the capture runs again without reuse: a vision tower
applied to images and then to videos, a checkpoint's recompute), with one floating input that
requires grad, called outside activation checkpointing, are reused (the marker's backward hands that input its gradient; how a caller checkpoints a layer
shows in no attribute). A reused layer's backward is billed only when autograd really ran its
marker's backward (LLaVA's last CLIP layer, whose output the projector skips, gets none).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxflops.capture.markers import repeat_marker
from fxflops.capture.reads import attribute, reads_run_code

_STRUCTURE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})  # compared as state and tree
_HOOK_FLAGS = {  # a hook registry -> the registries flagging how each of its hooks is called
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
}
_FLAGS = frozenset(flag for flags in _HOOK_FLAGS.values() for flag in flags)
_OWN_PACKAGE = __name__.split(".")[0] + "."
_MAX_DEPTH = 12  # object nesting compared below a module attribute; deeper values equal only themselves


@dataclass
class Reuse:
    """What a capture reused: ``{layer path: template path}``."""

    templates: dict[str, str] = field(default_factory=dict)


def layer_attributes(module: torch.nn.Module, ignored: frozenset[str], seen: tuple[int, ...] = ()) -> tuple:
    """A hashable key of everything ``module`` and its submodules hold that their parameters and
    buffers (:func:`layer_state`) do not: every submodule's path and class, and every instance
    attribute except those named in ``ignored`` and torch's own bookkeeping of parameters, buffers
    and children; hooks by their functions (a hook's handle id differs between equal layers). Two
    layers with equal keys run the same code on the same values (module docstring). ``seen``: the
    ids of the objects being keyed above this one (a reference back to one of them is a cycle)."""
    seen = (*seen, id(module))
    found = []
    for path, sub in module.named_modules():
        inner = seen if sub is module else (*seen, id(sub))
        state = vars(sub)
        attributes = tuple(
            (name, _hooks_key(state, name, inner) if name in _HOOK_FLAGS else _key(value, inner))
            for name, value in sorted(state.items())
            if name not in ignored and name not in _STRUCTURE and name not in _FLAGS
        )
        found.append((path, type(sub), attributes))
    return tuple(found)


def _hooks_key(state: dict[str, Any], name: str, seen: tuple[int, ...]) -> tuple:
    """The hooks of registry ``name`` in order, each with the flags saying how it is called."""
    flags = [state.get(flag, {}) for flag in _HOOK_FLAGS[name]]
    return tuple((_key(hook, seen), *(handle in flag for flag in flags)) for handle, hook in state[name].items())


def _key(value: Any, seen: tuple[int, ...]) -> Any:
    """A hashable key of ``value`` that is equal for two values only when code reading them cannot
    tell them apart (their own type, same contents); ``seen`` as for :func:`layer_attributes`.
    Scalars and other hashable values without attributes (dtypes, enums, sentinels) key as
    themselves: ``==`` for values, identity for objects."""
    if id(value) in seen:
        return ("cycle", len(seen) - seen.index(id(value)))
    if len(seen) > _MAX_DEPTH:
        return ("object", id(value))
    inner, kind = (*seen, id(value)), type(value)
    if issubclass(kind, torch.Tensor):
        return _tensor_key(value)
    if issubclass(kind, torch.nn.Module):
        return ("module", kind, layer_state(value), layer_attributes(value, frozenset(), seen))
    if reads_run_code(kind):  # torch's deprecated reduce_op warns on every read
        return ("object", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_key(item, inner) for item in value))
    if isinstance(value, dict):
        return (type(value), tuple((_key(k, inner), _key(v, inner)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_key(item, inner) for item in value))
    if isinstance(value, types.FunctionType):
        return _function_key(value, inner)
    if isinstance(value, types.MethodType):
        return ("method", _key(value.__func__, inner), _key(value.__self__, inner))
    if isinstance(value, functools.partial):
        return ("partial", _key(value.func, inner), _key(value.args, inner), _key(value.keywords, inner))
    state = attribute(value, "__dict__")
    if isinstance(state, dict) and not isinstance(value, type):  # a held object: its class and attributes
        return ("object", type(value), _key(state, inner))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return (type(value), value)


def _function_key(function: types.FunctionType, seen: tuple[int, ...]) -> tuple:
    """A function by its code, globals, defaults and closure: two lambdas made alike in two layers'
    ``__init__`` are equal, ``once`` and ``twice`` are not. fxflops' own functions (the capture's
    stand-ins installed on lifted modules) by their code alone: they are installed alike on every
    module of a kind, each closing over its own module."""
    if (function.__module__ or "").startswith(_OWN_PACKAGE) and not function.__module__.startswith(_OWN_PACKAGE + "models"):
        return ("function", function.__code__)
    cells = tuple(_cell_contents(cell) for cell in function.__closure__ or ())
    return (
        "function", function.__code__, id(function.__globals__),
        _key((function.__defaults__, function.__kwdefaults__, cells), seen),
    )


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


_EMPTY = object()


def _tensor_key(tensor: torch.Tensor) -> tuple:
    """A plain tensor attribute by its metadata and a digest of its values: code may read them
    (``range(int(self.n))``). A tensor whose values cannot be read here (meta, fake, sparse, a
    subclass, one whose storage is smaller than it: FSDP2 frees its all-gather buffers between
    steps) or larger than :data:`_DIGESTED_BYTES` is equal only to itself. The digest reads a copy:
    ``numpy()`` of the user's own storage would make it non-resizable for good (FSDP2's next
    all-gather resizes it)."""
    meta = (type(tensor), tuple(tensor.shape), tensor.dtype, tensor.device, tensor.layout, tensor.requires_grad)
    try:
        size = tensor.numel() * tensor.element_size()
        extent = tensor.storage_offset() + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride())) + 1
        if type(tensor) is not torch.Tensor or size > _DIGESTED_BYTES or tensor.untyped_storage().nbytes() < extent * tensor.element_size():
            return ("tensor", *meta, id(tensor))
        data = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except Exception:  # noqa: BLE001 - unreadable values: identity
        return ("tensor", *meta, id(tensor))
    return ("tensor", *meta, hashlib.sha256(data).digest())


_DIGESTED_BYTES = 1 << 20  # plain tensor attributes up to this size are compared by value


def layer_state(module: torch.nn.Module) -> tuple:
    return tuple(
        (name, tuple(t.shape), t.dtype, t.requires_grad)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    )


def _plain_autograd(backward: bool) -> bool:
    """Whether a layer is called the plain way: not under activation checkpointing (saved-tensor
    hooks, or the grad mode a reentrant checkpoint's forward turns off in a joint capture), whose
    recompute depends on how the caller checkpoints, which no layer attribute shows."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    return not hooks and (torch.is_grad_enabled() or not backward)


def _size(size: Any) -> Any:
    return str(size.node.expr) if isinstance(size, torch.SymInt) else size


def _call_key(args: tuple, kwargs: dict, backward: bool) -> tuple | None:
    """The call's identity for reuse, or None when it cannot be reused: in a joint capture, not
    exactly one floating input that requires grad (the one the marker's backward feeds)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key, grad_inputs = [str(spec)], 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.dtype.is_floating_point:
                key.append(("float", leaf.dtype, leaf.requires_grad, tuple(map(_size, leaf.shape))))
                grad_inputs += leaf.requires_grad
            else:
                key.append(("same tensor", id(leaf)))
        else:
            key.append(("value", repr(leaf)))
    floating = any(k[0] == "float" for k in key[1:])
    return tuple(key) if grad_inputs == 1 or (not backward and grad_inputs == 0 and floating) else None


class LayerCalledTwice(Exception):
    """A wrapped layer ran twice in one capture (a tower applied to images and then videos, a
    checkpoint's recompute): its template's terms would mix calls, so the capture runs again
    without reuse."""


@contextlib.contextmanager
def reusing_repeated_layers(
    model: torch.nn.Module, skip: set[str], backward: bool, enabled: bool = True, ignored: frozenset[str] = frozenset()
) -> Iterator[Reuse]:
    """Wrap every ``nn.ModuleList`` child of ``model`` (except paths in ``skip``) for one capture
    (``backward``: a joint one); yields the :class:`Reuse` filled as layers are called (see the
    module docstring). A layer called twice raises :class:`LayerCalledTwice`. ``ignored`` names
    attributes that differ between layers without changing what they compute (a model family's
    adapter knows them: transformers' ``layer_idx`` only indexes caches)."""
    reuse = Reuse()
    if not enabled:
        yield reuse
        return
    called: set[str] = set()
    layers = {
        f"{path}.{name}" if path else name: child
        for path, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        for name, child in module.named_children()
    }
    layers = {path: layer for path, layer in layers.items() if path not in skip and "forward" not in vars(layer)}
    templates: dict[tuple, tuple[str, Any, Any]] = {}  # kind + call -> (path, output spec, output leaves)
    kinds = {path: (type(layer), layer_state(layer), layer_attributes(layer, ignored)) for path, layer in layers.items()}

    def wrap(path: str, layer: torch.nn.Module) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if path in called:
                raise LayerCalledTwice(path)
            called.add(path)
            call = _call_key(args, kwargs, backward) if _plain_autograd(backward) else None
            key = None if call is None else (kinds[path], call)
            if key is None or key not in templates:
                out = type(layer).forward(layer, *args, **kwargs)
                if key is not None:
                    leaves, spec = pytree.tree_flatten(out)
                    templates[key] = (path, spec, leaves)
                return out
            template, spec, leaves = templates[key]
            reuse.templates[path] = template
            floats = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
            grad_input = next((t for t in floats if t.requires_grad), floats[0])
            marked = [
                repeat_marker(grad_input, list(leaf.shape), leaf.dtype, path) if isinstance(leaf, torch.Tensor) else leaf
                for leaf in leaves
            ]
            return pytree.tree_unflatten(marked, spec)

        return forward

    for path, layer in layers.items():
        layer.forward = wrap(path, layer)
    try:
        yield reuse
    finally:
        for layer in layers.values():
            del layer.forward
