"""Which input dimensions are free symbols, and what each symbol is called.

The forward call is bound to the parameter names of ``model.forward``; every tensor argument (also one
nested in a list, tuple or dict) gets an *access path* from that name, e.g. ``("input_ids",)`` or
``("images", 0)``. A :class:`DimSpec` says "dimension ``dim`` of the tensor at ``path`` is the symbol
``name``". Two specs with the same name are the same symbol.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.errors import InputError

Path = tuple[Any, ...]
RESERVED_NAMES = frozenset({"phase", "depth"})


@dataclass(frozen=True)
class DimSpec:
    """Dimension ``dim`` of the tensor input at ``path`` is the free symbol ``name``."""

    name: str
    path: Path
    dim: int


def bind_call(forward: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map the call's arguments to ``forward``'s parameter names (``*args`` become ``name[i]``)."""
    bound = inspect.signature(forward).bind(*args, **kwargs)
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
    """Every tensor in the bound call with its access path, in argument order."""
    found: dict[Path, torch.Tensor] = {}

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(path + (i,), item)
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(path + (key,), item)

    for name, value in named.items():
        visit((name,), value)
    return found


def path_label(path: Path) -> str:
    """``("images", 0)`` -> ``images_0``: the prefix of automatic symbol names."""
    return "_".join(str(p) for p in path)


def resolve_dims(
    dims: dict[str, dict[int, str]] | None, tensors: dict[Path, torch.Tensor]
) -> list[DimSpec]:
    """Turn the user's ``dims`` (or ``None`` = every dim free) into DimSpecs for these tensors.

    ``dims`` keys are argument names (or ``name_key`` labels of nested tensors), values map a
    dimension index (negative allowed) to a symbol name. Unknown names and out-of-range dims raise
    :class:`InputError` listing what exists. Metadata inputs that ``dims`` does not mention (integer
    tensors of rank 1 or 2, such as ``cu_seqlens`` or ``image_grid_thw``) keep dim 0 free, named
    ``<argument>_0``: it counts sequences or images, which must never be pinned.
    """
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


def is_metadata(tensor: torch.Tensor) -> bool:
    """Integer tensors of rank 1 or 2: offsets, grids, lengths (the inputs segment families come from)."""
    return tensor.dim() in (1, 2) and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)
