"""Per-image patch grids cut from padded images by ``image_sizes`` (the Pixtral vision tower:
Mistral 3, LightOnOCR, Mistral Large 3, LLaVA with a Pixtral tower), counted symbolically in the
number of patches kept.

These families' processors send ``pixel_values`` of shape (images, C, H, W), zero padded to the
largest image, and ``image_sizes`` (images, 2), each image's (height, width) in pixels. The Pixtral
tower (transformers, ``models/pixtral/modeling_pixtral.py``)

1. runs its patch convolution ``patch_conv`` (kernel = stride = p) on the whole padded batch: work
   in images·⌊H/p⌋·⌊W/p⌋, which the symbols of ``pixel_values`` carry;
2. keeps of image i the ⌊hᵢ/p⌋ × ⌊wᵢ/p⌋ patches its size covers (slices bounded by the values of
   ``image_sizes``), and its transformer runs on all N = Σᵢ ⌊hᵢ/p⌋·⌊wᵢ/p⌋ of them as one sequence,
   with a block-diagonal attention mask (dense attention: N² per head);

and the patch merger of Mistral 3 (``Mistral3PatchMerger``: ``spatial_merge_size`` k) unfolds each
image's ⌊hᵢ/p⌋ × ⌊wᵢ/p⌋ grid into k×k windows, M = Σᵢ ⌊⌊hᵢ/p⌋/k⌋·⌊⌊wᵢ/p⌋/k⌋ of them, before one
linear layer ``merging_layer`` on (M, k²·d).

N and M are functions of the values of ``image_sizes``, which no shape carries: they are **derived
sizes** (``capture/derived.py``), ``image_patches`` and ``merged_image_patches``, which the binder
computes from ``image_sizes`` per call. While capturing (on the capture's twin only):

- the tower runs as on one image of 1 × N patches: ``patch_conv`` still convolves the whole padded
  batch (step 1, its real cost), and hands the tower the first N of its patches as that image's
  grid; the tower's own code then slices, flattens, builds positions and its one-block mask and runs
  its transformer on N patches;
- the merger runs ``merging_layer`` on M rows of k²·d features taken from its input (in the model:
  M windows of k² patches; in both, the rest is data movement, no counted arithmetic).

Nothing with FLOPs is replaced: the stand-ins choose which rows a slice keeps, never what is
computed on them (the test checks forward and backward against FlopCounterMode per module). A tower
whose ``image_sizes`` is not the model's own input is captured as before (measured).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._sympy.functions import FloorDiv

from fxflops.capture.derived import RowSum, TracedSize, column
from fxflops.errors import CaptureError

PATCHES, MERGED = "image_patches", "merged_image_patches"
SIZES = "image_sizes"


def _takes(module: torch.nn.Module, *names: str) -> bool:
    try:
        return set(names) <= set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False


def _is_tower(module: torch.nn.Module) -> bool:
    """A Pixtral-style tower: forward(pixel_values, image_sizes), a ``patch_conv`` convolution whose
    kernel and stride are its ``patch_size``."""
    conv, p = getattr(module, "patch_conv", None), getattr(module, "patch_size", None)
    return (
        _takes(module, "pixel_values", SIZES) and isinstance(conv, torch.nn.Conv2d) and isinstance(p, int)
        and tuple(conv.kernel_size) == tuple(conv.stride) == (p, p) and conv.padding in ((0, 0), "valid")
    )


def _is_merger(module: torch.nn.Module) -> bool:
    """A Mistral 3-style patch merger: forward(image_features, image_sizes), k×k windows of patches
    of ``patch_size`` unfolded into one ``merging_layer`` linear."""
    k, layer = getattr(module, "spatial_merge_size", None), getattr(module, "merging_layer", None)
    return (
        _takes(module, "image_features", SIZES) and isinstance(k, int) and isinstance(getattr(module, "patch_size", None), int)
        and isinstance(layer, torch.nn.Linear) and layer.in_features % (k * k) == 0
    )


class PatchGrids:
    """The patch-grid handling of one model (see the module docstring), or :meth:`of` None."""

    def __init__(self, tower: str, patch: int, merger: str | None, merge: int) -> None:
        self.tower, self.patch, self.merger, self.merge = tower, patch, merger, merge

    @classmethod
    def of(cls, model: torch.nn.Module, signature: inspect.Signature) -> PatchGrids | None:
        """The handling for ``model`` when it has exactly one Pixtral-style tower (and at most one
        patch merger of the same patch size) and its forward takes ``image_sizes``."""
        if SIZES not in signature.parameters:
            return None
        towers = [(path, m) for path, m in model.named_modules() if _is_tower(m)]
        mergers = [(path, m) for path, m in model.named_modules() if _is_merger(m)]
        if len(towers) != 1 or len(mergers) > 1:
            return None
        (tower, module), = towers
        if mergers and mergers[0][1].patch_size != module.patch_size:
            return None
        if not mergers:
            return cls(tower, module.patch_size, None, 1)
        (merger, merging), = mergers
        return cls(tower, module.patch_size, merger, merging.spatial_merge_size)

    def derived_sizes(self, call: dict[str, Any]) -> tuple[RowSum, ...]:
        """N (and M with a merger) of a call with 4-D ``pixel_values`` and 2-D ``image_sizes``."""
        pixels, sizes = call.get("pixel_values"), call.get(SIZES)
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and isinstance(sizes, torch.Tensor) and sizes.dim() == 2):
            return ()
        h, w = FloorDiv(column(0), self.patch), FloorDiv(column(1), self.patch)
        found = [RowSum(PATCHES, (SIZES,), h * w)]
        if self.merger is not None:
            found.append(RowSum(MERGED, (SIZES,), FloorDiv(h, self.merge) * FloorDiv(w, self.merge)))
        return tuple(found)

    @contextlib.contextmanager
    def capturing(self, model: torch.nn.Module, sizes: dict[str, TracedSize]) -> Iterator[None]:
        """While ``model`` (the capture's twin) is traced with the derived sizes ``sizes``: the tower
        as on one image of 1 × N patches, the merger on M windows (see the module docstring)."""
        if PATCHES not in sizes:
            yield
            return
        tower = model.get_submodule(self.tower)
        conv = tower.patch_conv
        convolve = conv.forward
        one_image: list[bool] = []  # the tower is running as on one image (capturing thread only)

        def first_patches(x: torch.Tensor) -> torch.Tensor:
            out = convolve(x)  # (images, d, ⌊H/p⌋, ⌊W/p⌋): the whole padded batch, as the model convolves
            if not one_image:
                return out
            patches = sizes[PATCHES].symint
            kept = out.flatten(2).transpose(1, 2).flatten(0, 1).narrow(0, 0, patches)  # (N, d)
            return kept.transpose(0, 1).reshape(1, -1, 1, patches)  # one image, a 1 x N grid

        def tower_forward(pixel_values: torch.Tensor, image_sizes: Any = None, **kwargs: Any) -> Any:
            patches, source = sizes[PATCHES]  # read while tracing: make_fx's own SymInt and tensor
            if image_sizes is not source:
                raise CaptureError(
                    f"{type(tower).__name__} received image_sizes other than the model's own input; "
                    "its patch count cannot be derived from the call"
                )
            one_image.append(True)
            try:
                return type(tower).forward(tower, pixel_values, image_sizes=[(self.patch, patches * self.patch)], **kwargs)
            finally:
                one_image.pop()

        stand_ins = [(conv, "forward", first_patches), (tower, "forward", tower_forward)]
        if self.merger is not None:
            merger = model.get_submodule(self.merger)

            def merged(image_features: torch.Tensor, image_sizes: Any) -> torch.Tensor:
                windows, source = sizes[MERGED]
                if image_sizes is not source:
                    raise CaptureError(f"{type(merger).__name__} received image_sizes other than the model's own input")
                # M·k² <= N rows regrouped as (M, k²·d), the shape unfold gives: a view, so backward adds no reduction
                square = self.merge * self.merge
                rows = image_features.narrow(0, 0, windows * square)
                return merger.merging_layer(rows.reshape(windows, square * image_features.shape[-1]))

            stand_ins.append((merger, "forward", merged))
        for module, name, function in stand_ins:
            module.__dict__[name] = function
        try:
            yield
        finally:
            for module, name, _ in stand_ins:
                module.__dict__.pop(name, None)

