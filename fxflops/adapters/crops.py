"""Image crops projected onto the image tokens (Phi-4-multimodal), counted symbolically in the
number of image tokens.

Phi-4-multimodal's processor resizes each image to a grid of crops of the vision tower's size, adds
a global crop, and sends ``image_pixel_values`` (images, crops, C, H, W) padded to the most crops,
``image_attention_mask`` (the valid patches of each crop) and ``image_sizes`` (each resized image's
pixels). Its image embedding (transformers, ``models/phi4_multimodal/modeling_phi4_multimodal.py``,
``Phi4MultimodalImageEmbedding.forward``)

1. runs the vision tower on every crop of the padded batch (``get_img_features``: SigLIP-style
   tower with the patch mask, 2x2 average pooling): shapes only;
2. per image, reads its grid from ``image_sizes`` and its valid rows and columns from the mask's
   values, and lays out its global and sub-crop features with separator columns (slices, cats,
   repeats of two parameter rows: data movement);
3. projects each image's rows (linear, GELU, linear) and writes them to the image-token positions of
   ``input_ids`` (``index_put``): all images' rows are exactly the image tokens.

So the work of step 3 is in T, the number of image tokens, a **derived size**
(``capture/derived.py``, :class:`~fxflops.capture.derived.TokenCount`): ``image_tokens``, the
elements of ``input_ids`` equal to the image token, which the binder counts per call (tensor ops on
the input's device). The feature embedding around it calls the image embedding only
``if (input_ids == image_token_id).any()``, which the program's guard T ≥ 1 decides.

While capturing (the capture's twin only), the image embedding runs step 1 as the model does, takes
T rows of its features (a view of one row, expanded: no counted work, forward or backward) as step
2's layout, projects them as step 3 does and writes them to the first T token rows (positions change
no counted work); the feature embedding runs its own code with the ``.any()`` of its image-token test
True. Exact under the matmul-family count (FlopCounterMode's, every MFU convention): step 2's work
and its backward are not in the trace, so a program with it refuses ``count="all"``
(``DerivedSize.leaves_out``). A call without image tokens is captured without the stand-ins, and
measured (``fxflops/islands.py``). Audio features are ``adapters/audio.py``'s.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fxflops.capture.derived import TokenCount, TracedSize
from fxflops.errors import CaptureError

TOKENS = "image_tokens"
PIXELS, IDS = "image_pixel_values", "input_ids"
# names of the crop inputs' dims: images, crops per image (padded), each crop's pixels
CROP_DIMS = {PIXELS: {0: "images", 1: "crops", 3: "crop_height", 4: "crop_width"}, "image_attention_mask": {0: "images", 1: "crops"}}
# what the stand-in does not trace (only count="all" counts it: DerivedSize.leaves_out)
LEFT_OUT = "the per-image layout's elementwise work (the mask's row and column sums) and its backward"
_EMBEDDING_INPUTS = {IDS, "inputs_embeds", PIXELS, "image_sizes", "image_attention_mask"}


def _is_owner(module: torch.nn.Module) -> bool:
    """An image embedding with Phi-4-multimodal's parts: ``get_img_features`` running its tower
    ``img_processor``, the two projections, and a forward taking the image-token ids, the embeddings and the crop inputs."""
    if not callable(getattr(module, "get_img_features", None)) or not isinstance(getattr(module, "img_processor", None), torch.nn.Module):
        return False
    if not all(isinstance(getattr(module, m, None), torch.nn.Linear) for m in ("img_projection_up", "img_projection_down")):
        return False
    try:
        return _EMBEDDING_INPUTS <= set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False


class TokensPresent(TorchFunctionMode):
    """While active: ``.any()`` of ``ids == token`` (``ids`` the traced ``input_ids``) is True, as the
    program's guard (at least one image token) makes it; every other op as is."""

    def __init__(self, ids: torch.Tensor, token: int) -> None:
        super().__init__()
        self.ids, self.token, self.tests = ids, token, []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.any and len(args) == 1 and not kwargs and any(args[0] is t for t in self.tests):
            return True
        out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.__eq__, torch.eq) and len(args) == 2 and args[0] is self.ids and isinstance(args[1], int) and args[1] == self.token:
            self.tests.append(out)
        return out


class ImageCrops:
    """The crop handling of one model (see the module docstring), or :meth:`of` None."""

    def __init__(self, owner: str, token: int) -> None:
        self.owner, self.token = owner, token

    @classmethod
    def of(cls, model: torch.nn.Module, signature: inspect.Signature) -> ImageCrops | None:
        """The handling for ``model`` when exactly one of its modules is such an image embedding, its
        config names the image token, and the model's forward takes the crops and ``input_ids``."""
        if not {PIXELS, IDS} <= set(signature.parameters):
            return None
        owners = [(path, m) for path, m in model.named_modules() if _is_owner(m)]
        if len(owners) != 1 or not owners[0][0]:
            return None
        (path, owner), = owners
        token = getattr(getattr(getattr(owner, "config", None), "vision_config", None), "image_token_id", None)
        return cls(path, token) if isinstance(token, int) else None

    def derived_sizes(self, call: dict[str, Any]) -> tuple[TokenCount, ...]:
        """T of a call with crops and image tokens."""
        ids, pixels = call.get(IDS), call.get(PIXELS)
        if not (isinstance(ids, torch.Tensor) and isinstance(pixels, torch.Tensor)):
            return ()
        tokens = TokenCount(TOKENS, (IDS,), least=1, token=self.token, leaves_out=LEFT_OUT)
        return (tokens,) if tokens.value(ids) >= tokens.least else ()

    @contextlib.contextmanager
    def capturing(self, model: torch.nn.Module, sizes: dict[str, TracedSize]) -> Iterator[None]:
        """While ``model`` (the capture's twin) is traced with the derived sizes ``sizes``: its image
        embedding on T rows, its feature embedding's image-token test True (see the module docstring)."""
        if TOKENS not in sizes:
            yield
            return
        owner = model.get_submodule(self.owner)
        parent = model.get_submodule(self.owner.rpartition(".")[0])
        own = parent.forward

        def embed(input_ids: torch.Tensor, inputs_embeds: torch.Tensor, image_pixel_values: torch.Tensor,
                  image_sizes: Any = None, image_attention_mask: Any = None) -> torch.Tensor:
            tokens, ids = sizes[TOKENS]  # read while tracing: make_fx's own SymInt and tensor
            if input_ids is not ids or image_attention_mask is None:
                raise CaptureError(f"{type(owner).__name__} received input_ids other than the model's own, or no image_attention_mask")
            up = owner.img_projection_up.weight
            pixels = image_pixel_values.to(next(owner.img_processor.parameters()).dtype).flatten(0, 1)
            mask = image_attention_mask.flatten(0, 1).to(dtype=torch.bool, device=up.device)
            features = owner.get_img_features(pixels, attention_mask=mask)
            rows = features.reshape(-1, features.shape[-1])[:1].expand(tokens, features.shape[-1])
            projected = owner.img_projection_down(torch.nn.functional.gelu(owner.img_projection_up(rows.to(up.device, up.dtype))))
            flat = inputs_embeds.reshape(-1, inputs_embeds.shape[-1])
            first = torch.arange(tokens, device=flat.device)
            written = flat.index_put((first,), projected.to(dtype=flat.dtype, device=flat.device)).view_as(inputs_embeds)
            drop = getattr(owner, "drop", None)
            return drop(written) if isinstance(drop, torch.nn.Module) else written

        def feature_embedding(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with TokensPresent(input_ids, self.token):
                return own(input_ids, *args, **kwargs)

        owner.__dict__["forward"], parent.__dict__["forward"] = embed, feature_embedding
        try:
            yield
        finally:
            owner.__dict__.pop("forward", None)
            parent.__dict__.pop("forward", None)
