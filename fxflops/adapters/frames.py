"""Padding frames dropped by their pixel values (Idefics2, Idefics3, SmolVLM), counted symbolically
in the number of real frames.

These families' processors split each image into frames (tiles of the vision tower's size, plus a
global frame; Idefics2 by default one frame per image) and send ``pixel_values`` of shape (batch, frames, C, H, W): each sequence's frames,
padded to the batch's most with frames that are all zero. The model's ``get_image_features``
(transformers, ``models/idefics3/modeling_idefics3.py``, ``models/smolvlm/modeling_smolvlm.py``)

1. keeps the R frames that are not all zero (``pixel_values[real_images_inds]``: a selection by
   pixel values, which no shape carries);
2. runs its vision tower ``vision_model`` on the R frames (patch convolution, transformer) with a
   patch attention mask of each frame's valid pixels (positions and masking: no counted arithmetic,
   the same work for any mask);
3. runs its ``connector`` (Idefics3: pixel shuffle + one linear layer; Idefics2: an MLP and a
   perceiver resampler of fixed latents attending to each frame's patches under its patch mask) on
   the R frames' features, and hands them to the language model as one piece per sequence (a
   split: data movement, kept packed while capturing, ``adapters/pieces.py``).

R is a **derived size** (``capture/derived.py``), ``image_frames``: the rows of ``pixel_values``
(batch and frames flattened) holding any non-zero value, which the binder counts per call (tensor
ops on the input's device: no host sync). While capturing (on the capture's twin only), the model's
own ``get_image_features`` runs, every line of it, with one change: indexing a tensor along its
flattened frames by a boolean mask of as many frames (``pixel_values[real_images_inds]``, the
pixel attention mask's same selection) keeps the first R frames instead. Every frame has the same
shape, so the kept rows are computed on exactly as the R real ones, and everything else the model
does (the zero test and its sums, SmolVLM's fallback, the patch mask, the tower, the connector) is
traced as it is, under every convention. A call whose frames are all zero (SmolVLM then runs its
first frame anyway, Idefics3 none) is outside the program (its guard R ≥ 1) and is captured without
the stand-in: the model's own selection then makes its capture measured (``fxflops/islands.py``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fxflops.capture.derived import NonZeroRows, TracedSize
from fxflops.errors import CaptureError

FRAMES = "image_frames"
PIXELS = "pixel_values"
# names of the frame inputs' dims: sequences, frames per sequence (padded), each frame's pixels
FRAME_DIMS = {
    PIXELS: {0: "batch", 1: "frames", 3: "frame_height", 4: "frame_width"},
    "pixel_attention_mask": {0: "batch", 1: "frames", 2: "frame_height", 3: "frame_width"},
}


def _is_owner(module: torch.nn.Module) -> bool:
    """A model whose own ``get_image_features(pixel_values, pixel_attention_mask)`` runs its
    ``vision_model`` (forward taking ``patch_attention_mask``) and its ``connector``."""
    getter, tower = getattr(module, "get_image_features", None), getattr(module, "vision_model", None)
    if not (callable(getter) and isinstance(tower, torch.nn.Module) and isinstance(getattr(module, "connector", None), torch.nn.Module)):
        return False
    try:
        takes = set(inspect.signature(getter).parameters), set(inspect.signature(tower.forward).parameters)
    except (TypeError, ValueError):
        return False
    return {PIXELS, "pixel_attention_mask"} <= takes[0] and {PIXELS, "patch_attention_mask"} <= takes[1]


class FirstFrames(TorchFunctionMode):
    """While active: ``tensor[mask]`` with a 1-D boolean ``mask`` as long as ``tensor``'s dim 0, which
    is ``rows`` (the flattened frames), is ``tensor.narrow(0, 0, frames)``; every other op as is."""

    def __init__(self, rows: Any, frames: torch.SymInt) -> None:
        super().__init__()
        self.rows, self.frames = _expression(rows), frames

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.__getitem__ and len(args) == 2 and self._selects_frames(*args):
            return args[0].narrow(0, 0, self.frames)
        return func(*args, **(kwargs or {}))

    def _selects_frames(self, tensor: Any, index: Any) -> bool:
        return (
            isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.dim() == 1
            and isinstance(tensor, torch.Tensor) and tensor.dim() >= 1
            and _expression(index.shape[0]) == _expression(tensor.shape[0]) == self.rows
        )


def _expression(size: Any) -> Any:
    """A size as a comparable value (a SymInt's sympy expression; an int as is), without a guard."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


class RealFrames:
    """The real-frame handling of one model (see the module docstring), or :meth:`of` None."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    @classmethod
    def of(cls, model: torch.nn.Module, signature: inspect.Signature) -> RealFrames | None:
        """The handling for ``model`` when exactly one of its modules owns such a
        ``get_image_features`` and its forward takes ``pixel_values``."""
        if PIXELS not in signature.parameters:
            return None
        owners = [path for path, m in model.named_modules() if _is_owner(m)]
        return cls(owners[0]) if len(owners) == 1 else None

    def derived_sizes(self, call: dict[str, Any]) -> tuple[NonZeroRows, ...]:
        """R of a call with 5-D ``pixel_values`` (batch, frames, C, H, W)."""
        pixels = call.get(PIXELS)
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 5):
            return ()
        frames = NonZeroRows(FRAMES, (PIXELS,), lead=2, least=1)
        # a call whose frames are all padding: the model's own fallback decides what runs (measured)
        return (frames,) if frames.value(pixels) >= frames.least else ()

    @contextlib.contextmanager
    def capturing(self, model: torch.nn.Module, sizes: dict[str, TracedSize]) -> Iterator[None]:
        """While ``model`` (the capture's twin) is traced with the derived sizes ``sizes``: its
        ``get_image_features`` keeping the first R frames (see the module docstring)."""
        if FRAMES not in sizes:
            yield
            return
        owner = model.get_submodule(self.owner)
        own = owner.get_image_features

        def features(pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frames, source = sizes[FRAMES]  # read while tracing: make_fx's own SymInt and tensor
            if pixel_values is not source:
                raise CaptureError(f"{type(owner).__name__}.get_image_features received pixel_values other than the model's own input")
            with FirstFrames(pixel_values.shape[0] * pixel_values.shape[1], frames):
                return own(pixel_values, *args, **kwargs)

        owner.__dict__["get_image_features"] = features
        try:
            yield
        finally:
            owner.__dict__.pop("get_image_features", None)
