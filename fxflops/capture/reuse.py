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
- the same plain attributes (numbers, strings, flags) on the layer and every submodule: Gemma's
  sliding and full attention layers, a checkpointed layer, a differently sized layer, a layer that
  stores its own index are different kinds. Only a model family's adapter may name attributes to
  ignore: transformers layers' ``layer_idx`` only indexes caches (every index-dependent choice in
  transformers 5.x is made in ``__init__`` as an attribute or a submodule class);
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxflops.capture.markers import repeat_marker

_PLAIN = (bool, int, float, str, type(None))


@dataclass
class Reuse:
    """What a capture reused: ``{layer path: template path}``."""

    templates: dict[str, str] = field(default_factory=dict)


def layer_attributes(module: torch.nn.Module, ignored: frozenset[str]) -> tuple:
    """The plain attributes of ``module`` and its submodules, except those named in ``ignored``."""
    found = []
    for path, sub in module.named_modules():
        for name, value in sorted(vars(sub).items()):
            if name.startswith("_") or name in ignored:
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                found.append((path, name, value))
    return tuple(found)


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
