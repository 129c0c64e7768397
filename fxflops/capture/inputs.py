"""Which input dimensions are free symbols, and what each symbol is called.

The forward call is bound to the parameter names of ``model.forward``; every tensor argument (also one
nested in a list, tuple or dict, or held by an object passed in, such as a key-value cache) gets an
*access path* from that name, e.g. ``("input_ids",)``, ``("images", 0)`` or
``("past_key_values", Attr("layers"), 0, Attr("keys"))``. Tensors an argument object holds are
inputs like any other: a cache's length is a symbol, not a constant of the trace. A :class:`DimSpec` says "dimension ``dim`` of the tensor at ``path`` is the symbol
``name``". Two specs with the same name are the same symbol.
"""

from __future__ import annotations

import collections
import enum
import inspect
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxflops.capture.reads import attribute
from fxflops.errors import CaptureError, InputError

Path = tuple[Any, ...]
RESERVED_NAMES = frozenset({"phase", "depth"})
_NOT_HELD_STATE = (torch.nn.Module, types.FunctionType, types.MethodType, types.BuiltinFunctionType, type, enum.Enum)
MAX_HELD_DEPTH = 6  # object nesting followed below an argument


@dataclass(frozen=True)
class Attr:
    """A path step to an attribute of an object (a cache's ``layers``, a cache layer's ``keys``)."""

    name: str

    def __str__(self) -> str:
        return self.name


SEQUENCES = (list, tuple, collections.deque)  # containers whose items are the trace's inputs (as pytree flattens them)


def opaque_container(value: Any) -> bool:
    """A list, tuple or dict of a subclass torch's pytree does not flatten (``class Batch(dict)``):
    one leaf to the trace, whose tensors are its constants (their shapes part of the call's key)."""
    kind = type(value)
    return (
        kind is not list and kind is not tuple and kind is not dict and isinstance(value, (list, tuple, dict))
        and pytree._get_node_type(value) not in pytree.SUPPORTED_NODES
    )


def held_state(value: Any) -> dict[str, Any] | None:
    """The attributes of an argument object whose tensors are inputs (a key-value cache, a config
    passed in); None for what is not such an object (tensors, containers, scalars, modules, functions)."""
    if isinstance(value, (torch.Tensor, list, tuple, dict, _NOT_HELD_STATE)) or callable(value):
        return None
    return attribute(value, "__dict__")


@dataclass(frozen=True)
class DimSpec:
    """Dimension ``dim`` of the tensor input at ``path`` is the free symbol ``name``."""

    name: str
    path: Path
    dim: int


def signature_of(forward: Any) -> inspect.Signature:
    """``inspect.signature`` of a forward; for a TorchScript method that has none (``torch.jit.trace``
    keeps no Python signature), the arguments of its schema after ``self``."""
    try:
        return inspect.signature(forward)
    except (ValueError, TypeError):
        schema = getattr(forward, "schema", None)
        if schema is None:
            raise
        return inspect.Signature([
            inspect.Parameter(
                a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=a.default_value if a.has_default_value() else inspect.Parameter.empty,
            )
            for a in schema.arguments[1:]
        ])


def bind_call(forward: Any, args: tuple, kwargs: dict, signature: inspect.Signature | None = None) -> dict[str, Any]:
    """Map the call's arguments to ``forward``'s parameter names (``*args`` become ``name[i]``);
    ``signature``: ``forward``'s, when the caller keeps it (working it out costs tens of µs)."""
    bound = (signature or signature_of(forward)).bind(*args, **kwargs)
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def tensor_leaves(named: dict[str, Any]) -> dict[Path, torch.Tensor]:
    """Every tensor in the bound call with its access path, in argument order (an object reachable
    twice is followed once)."""
    return _leaves(named, ints=False)


def held_ints(named: dict[str, Any]) -> dict[Path, int]:
    """Every integer an argument object holds (a sliding-window cache layer's ``cumulative_length``):
    inputs of the trace like the tensors, as symbols whose values the binder reads."""
    return {path: value for path, value in _leaves(named, ints=True).items() if not isinstance(value, torch.Tensor)}


def _leaves(named: dict[str, Any], ints: bool) -> dict[Path, Any]:
    found: dict[Path, Any] = {}
    seen: set[int] = set()

    def visit(path: Path, value: Any, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor) or ints and depth and type(value) is int:
            found[path] = value
        elif opaque_container(value):  # constants of the trace, not inputs
            return
        elif isinstance(value, SEQUENCES):
            for i, item in enumerate(value):
                visit(path + (i,), item, depth)
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(path + (key,), item, depth)
        elif (state := held_state(value)) is not None and depth < MAX_HELD_DEPTH and id(value) not in seen:
            seen.add(id(value))
            for key, item in state.items():
                visit(path + (Attr(key),), item, depth + 1)

    for name, value in named.items():
        visit((name,), value)
    return found


def path_label(path: Path) -> str:
    """``("images", 0)`` -> ``images_0``: the prefix of automatic symbol names."""
    return "_".join(str(p) for p in path)


def held_root(path: Path) -> int | None:
    """The index in ``path`` of the argument object its tensor is held by (the step before its first
    attribute step), or None for a tensor reached through containers only."""
    return next((i - 1 for i, step in enumerate(path) if isinstance(step, Attr)), None)


def put(holder: Any, steps: Path, value: Any) -> Any:
    """``holder`` with the item at ``steps`` below it set to ``value``: objects, lists and dicts in
    place, tuples rebuilt (returned)."""
    step, rest = steps[0], steps[1:]
    child = vars(holder)[step.name] if isinstance(step, Attr) else holder[step]
    new = put(child, rest, value) if rest else value
    if isinstance(holder, tuple):
        return holder[:step] + (new,) + holder[step + 1 :]
    if isinstance(step, Attr):
        vars(holder)[step.name] = new
    else:
        holder[step] = new
    return holder


def reach(value: Any, steps: Path) -> Any:
    """The item at ``steps`` below ``value``."""
    for step in steps:
        value = vars(value)[step.name] if isinstance(step, Attr) else value[step]
    return value


def resolve_dims(
    dims: dict[str, dict[int, str]] | None, tensors: dict[Path, torch.Tensor]
) -> list[DimSpec]:
    """Turn the user's ``dims`` (or ``None`` = every dim free) into DimSpecs for these tensors.

    ``dims`` keys are argument names (or ``name_key`` labels of nested tensors), values map a
    dimension index (negative allowed) to a symbol name. Unknown names and out-of-range dims raise
    :class:`InputError` listing what exists. Metadata inputs that ``dims`` does not mention (integer
    tensors of rank 1 or 2, such as ``cu_seqlens`` or ``image_grid_thw``) keep dim 0 free, named
    ``<argument>_0``: it counts sequences or images, which must never be pinned. An input no fake
    dense tensor can stand for is refused first (:func:`refuse_untraceable`).
    """
    refuse_untraceable(tensors)
    if dims is None:
        return [
            DimSpec(f"{path_label(path)}_{d}", path, d)
            for path, tensor in tensors.items()
            for d in range(tensor.dim())
        ]
    by_label = {path_label(path): path for path in tensors}
    specs = [
        DimSpec(f"{label}_0", path, 0)
        for label, path in by_label.items()
        if label not in dims and is_metadata(tensors[path])
    ]
    for label, per_dim in dims.items():
        if label not in by_label:
            raise InputError(
                f"dims names input {label!r}, but the call's tensor inputs are {sorted(by_label)}"
            )
        path = by_label[label]
        rank = tensors[path].dim()
        for d, name in per_dim.items():
            if not -rank <= d < rank:
                raise InputError(f"dims[{label!r}] names dim {d}, but {label} has rank {rank}")
            if not name.isidentifier() or name in RESERVED_NAMES:
                raise InputError(
                    f"symbol name {name!r} for {label}[{d}] must be an identifier other than "
                    f"{sorted(RESERVED_NAMES)} (keywords of Program.total/breakdown)"
                )
            specs.append(DimSpec(name, path, d % rank))
    return specs


def refuse_untraceable(tensors: dict[Path, torch.Tensor]) -> None:
    """Raise :class:`CaptureError` naming the first input a fake dense tensor cannot stand for: its
    layout or a view bit changes which ops run and what they compute (a sparse input's ``to_dense()``,
    a conjugate view's ``resolve_conj()``), and a fake has neither; so does an input carrying Python
    attributes that hold more than plain values (a fake carries plain ones, ``symbols.fake_like``).
    Each is refused at the root module (``module=""``): the wrapper measures the model's own code
    on such calls (``fxflops/islands.py``). Not a nested tensor: it has no sizes to measure by."""
    for path, tensor in tensors.items():
        reason = _untraceable(tensor)
        if reason is not None:  # measured at the root instead, but a nested tensor, which has no sizes to measure by
            where = None if tensor.is_nested else ""
            raise CaptureError(f"input {path_label(path)!r} {reason}: fxflops traces dense strided tensors only", module=where)
        held = [name for name, value in own_attributes(tensor).items() if not _plain_attribute(value)]
        if held:  # the model's own code is measured instead (``fxflops/islands.py``)
            names = ", ".join(map(repr, held))
            raise CaptureError(f"input {path_label(path)!r} carries Python attributes a traced stand-in cannot hold ({names}): only plain values", module="")


def _untraceable(tensor: torch.Tensor) -> str | None:
    """What makes ``tensor`` a kind no fake dense tensor stands for, or None."""
    if tensor.is_nested:
        return "is a nested tensor"
    if tensor.layout != torch.strided:
        return f"has layout {tensor.layout}"
    if tensor.is_conj():
        return "is a conjugate view (conj bit set; resolve_conj() makes it plain)"
    if tensor.is_neg():
        return "is a negative view (neg bit set; resolve_neg() makes it plain)"
    if overrides_torch_functions(tensor):
        return f"is a {type(tensor).__name__}, whose __torch_function__ runs its own code on every op"
    return None


def overrides_torch_functions(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s class runs its own ``__torch_function__`` (a subclass auditing, casting
    or computing on each op): a fake stands for a plain tensor, so the trace would not run it."""
    function = getattr(type(tensor).__torch_function__, "__func__", type(tensor).__torch_function__)
    return function is not _TENSOR_TORCH_FUNCTION and function is not torch._C._disabled_torch_function_impl


_TENSOR_TORCH_FUNCTION = torch.Tensor.__torch_function__.__func__


def own_attributes(tensor: torch.Tensor) -> Mapping[str, Any]:
    """The Python attributes a user or a data pipeline set on a tensor (``x.packed = True``): its
    ``__dict__`` for a plain tensor; none for a subclass, whose ``__dict__`` holds its own machinery
    (a FakeTensor's mode), nor for a parameter passed in, whose attributes are a training
    framework's bookkeeping (Megatron's ``main_grad``)."""
    return tensor.__dict__ if type(tensor) in PLAIN_TENSORS else _NONE


PLAIN_TENSORS = (torch.Tensor,)
_NONE: Mapping[str, Any] = types.MappingProxyType({})


def _plain_attribute(value: Any) -> bool:
    """A value a tensor's Python attribute may hold for the trace's stand-in to carry it
    (``fake_like``): a number, string, flag, dtype, device, enum, or a tuple of them."""
    if isinstance(value, tuple):
        return all(map(_plain_attribute, value))
    return isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device, enum.Enum))


def is_metadata(tensor: torch.Tensor) -> bool:
    """Integer tensors of rank 1 or 2: offsets, grids, lengths (the inputs segment families come from)."""
    return tensor.dim() in (1, 2) and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)
