"""Anyres tiles: images cut into a base tile and a grid of tiles chosen from each image's size
(LLaVA-NeXT, LLaVA-NeXT-Video, LLaVA-OneVision), counted symbolically in the number of tiles.

These families' processors send ``pixel_values`` of shape (images, most tiles, C, H, W), padded
per image, and ``image_sizes`` (images, 2). The base model's ``get_image_features`` (transformers,
``models/llava_next/modeling_llava_next.py``)

1. finds each image's tiles from its size, ``image_size_to_num_patches(size, config.image_grid_pinpoints,
   config.vision_config.image_size)`` (a loop over the pinpoints, on the host; LLaVA-OneVision takes
   one tile per image of a sequence holding several, ``batch_num_images``),
2. keeps those tiles, ``torch.cat([pixels[i, :nᵢ] for i])``: T = Σᵢ nᵢ tiles,
3. runs the vision tower and the projector on the T tiles (the FLOPs: linear in T, each tile a fixed
   size),
4. cuts the result per image and packs each (``pack_image_features``: views, unpadding slices, a
   newline column concatenated, OneVision's resize of large grids; data movement, no arithmetic
   fxflops or FlopCounterMode counts).

Steps 1, 2 and 4 read the values of ``image_sizes`` and loop per image, which a symbolic trace cannot
do without fixing the number of images and their sizes. So:

- **prepare** (every call, on the host): step 1 with the model module's own function, and step 2: the
  model receives ``pixel_values`` as the T tiles, (T, C, H, W), a form its ``get_image_features``
  takes as is (the model then skips its own copy: the work is moved, not added); the program binds
  ``tiles`` = T. ``image_sizes`` on an accelerator is read to the host here, as the model reads it
  itself per image.
- **capturing** (the capture's twin only): inside ``get_image_features``, step 1 answers "all T tiles
  are one image" and step 4 keeps the one packed piece, so the trace runs steps 3 on T symbolic
  tiles; nothing with FLOPs is left out (the test checks step 4 runs no counted op).

A call whose tiles do not fit its ``pixel_values`` (an image needing more tiles than the padding
holds, or image_sizes and pixel_values of different image counts) raises
:class:`~fxflops.errors.MetadataError` naming both inputs, before the model runs.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch

from fxflops.capture.inputs import bind_call
from fxflops.capture.scope import patched
from fxflops.errors import MetadataError

TILES_OF_IMAGE = "image_size_to_num_patches"  # transformers' per-image tile count, in the family's module
PACK = "pack_image_features"


class AnyresTiles:
    """The anyres-tiles handling of one model (see the module docstring), or :meth:`of` None."""

    def __init__(self, path: str, owner: torch.nn.Module, signature: inspect.Signature) -> None:
        self.path, self.owner = path, owner
        self.module = sys.modules[type(owner).__module__]
        self.per_image_grids = "batch_num_images" in inspect.signature(owner.get_image_features).parameters
        self._signature = signature
        names = list(signature.parameters)
        self._pixels_at = names.index("pixel_values")

    @classmethod
    def of(cls, model: torch.nn.Module, signature: inspect.Signature) -> AnyresTiles | None:
        """The handling for ``model`` when one of its modules is an anyres-tiles base model (it has
        ``pack_image_features`` and a ``get_image_features`` taking ``image_sizes``, its module defines
        ``image_size_to_num_patches``) and ``model.forward`` takes ``pixel_values`` and ``image_sizes``."""
        if not {"pixel_values", "image_sizes"} <= set(signature.parameters):
            return None
        owners = [
            (path, module) for path, module in model.named_modules()
            if callable(getattr(module, PACK, None)) and callable(getattr(module, "get_image_features", None))
            and "image_sizes" in inspect.signature(module.get_image_features).parameters
            and callable(getattr(sys.modules.get(type(module).__module__), TILES_OF_IMAGE, None))
        ]
        # the innermost: a task model's get_image_features delegates to its base model's
        innermost = [(path, m) for path, m in owners if not any(_below(other, path) for other, _ in owners)]
        return cls(*innermost[0], signature) if len(innermost) == 1 else None
        return None

    # ---- every call ---------------------------------------------------------------------------
    def prepare(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call with ``pixel_values`` as the tiles the model keeps, (T, C, H, W), when it comes
        padded per image (5 dims); any other call as it is."""
        pixels = args[self._pixels_at] if len(args) > self._pixels_at else kwargs.get("pixel_values")
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 5:
            return args, kwargs
        call = bind_call(None, args, kwargs, self._signature)
        sizes = call.get("image_sizes")
        if sizes is None:
            raise MetadataError("pixel_values of 5 dims (images, tiles, C, H, W) need image_sizes (each image's (height, width))")
        counts = self.tiles_per_image(sizes, call.get("batch_num_images"))
        if len(counts) != pixels.shape[0] or max(counts, default=0) > pixels.shape[1]:
            raise MetadataError(
                f"image_sizes ask for {counts} tiles per image, but pixel_values holds {pixels.shape[0]} images "
                f"of at most {pixels.shape[1]} tiles"
            )
        tiles = torch.cat([pixels[i, :n] for i, n in enumerate(counts)])
        if len(args) > self._pixels_at:
            return (*args[: self._pixels_at], tiles, *args[self._pixels_at + 1 :]), kwargs
        return args, {**kwargs, "pixel_values": tiles}

    def tiles_per_image(self, image_sizes: Any, batch_num_images: Any = None) -> list[int]:
        """nᵢ as ``get_image_features`` computes them: the family's ``image_size_to_num_patches`` of each
        image's size with the config's pinpoints and tile size; with ``batch_num_images``
        (LLaVA-OneVision), an image sharing its sequence with others is its base tile alone."""
        config = self.owner.config
        sizes = image_sizes.tolist() if isinstance(image_sizes, torch.Tensor) else list(image_sizes)
        tiled = [True] * len(sizes)
        if self.per_image_grids and batch_num_images is not None:
            per_sequence = batch_num_images.tolist() if isinstance(batch_num_images, torch.Tensor) else list(batch_num_images)
            tiled = [n == 1 for n in per_sequence for _ in range(n)]
        tiles_of = getattr(self.module, TILES_OF_IMAGE)
        return [
            tiles_of(image_size=size, grid_pinpoints=config.image_grid_pinpoints, patch_size=config.vision_config.image_size)
            if one else 1
            for size, one in zip(sizes, tiled)
        ]

    # ---- the capture --------------------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self, model: torch.nn.Module) -> Iterator[None]:
        """While ``model`` (the capture's twin) is traced: its anyres owner's ``get_image_features``
        given (T, C, H, W) tiles runs with the T tiles as one image (see the module docstring)."""
        owner = model.get_submodule(self.path)
        getter = owner.get_image_features
        names = list(inspect.signature(getter).parameters)
        tiles: list[Any] = []  # T of the get_image_features running (capturing thread only)

        def one_image(*args: Any, **kwargs: Any) -> Any:
            pixels, sizes = _argument(names, args, kwargs, "pixel_values"), _argument(names, args, kwargs, "image_sizes")
            if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or not isinstance(sizes, torch.Tensor):
                return getter(*args, **kwargs)
            # one image: its size is read by the stand-ins only; a sequence of one image is tiled
            args, kwargs = _replaced(names, args, kwargs, "image_sizes", sizes.new_zeros((1, 2)))
            if _argument(names, args, kwargs, "batch_num_images") is not None:
                args, kwargs = _replaced(names, args, kwargs, "batch_num_images", None)
            tiles.append(pixels.shape[0])
            try:
                return getter(*args, **kwargs)
            finally:
                tiles.pop()

        def packed_as_one(image_features: Any, *args: Any, **kwargs: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
            if not tiles:
                return pack(image_features, *args, **kwargs)
            features = [piece.flatten(0, 1) for piece in image_features]  # one piece: all tiles' features
            return features, features[0].new_full((1,), features[0].shape[0], dtype=torch.long)  # its length

        pack = owner.pack_image_features
        with patched(self.module, TILES_OF_IMAGE, lambda *a, **k: tiles[-1] if tiles else tiles_of(*a, **k)) as tiles_of:
            owner.__dict__["get_image_features"] = one_image
            owner.__dict__[PACK] = packed_as_one
            try:
                yield
            finally:
                owner.__dict__.pop("get_image_features", None)
                owner.__dict__.pop(PACK, None)


def _below(path: str, ancestor: str) -> bool:
    """The module at ``path`` is a descendant of the one at ``ancestor`` ("" the root)."""
    return path.startswith(ancestor + ".") if ancestor else path != ""


def _argument(names: list[str], args: tuple, kwargs: dict, name: str) -> Any:
    """The value of parameter ``name`` in a call ``(args, kwargs)`` of a function whose parameters are ``names``."""
    i = names.index(name) if name in names else len(args)
    return args[i] if i < len(args) else kwargs.get(name)


def _replaced(names: list[str], args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    """The call with parameter ``name`` given ``value``, where the call gave it (positionally or by keyword)."""
    i = names.index(name)
    if i < len(args):
        return (*args[:i], value, *args[i + 1 :]), kwargs
    return args, {**kwargs, name: value}
