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
``if (input_ids == image_token_id).any()``, which the program's guard T ≥ 1 decides
(``adapters/token_embeddings.py``, shared with the audio embedding).

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
from collections.abc import Iterator

import torch

from fxflops.adapters.token_embeddings import TokenEmbedding, has_parts, standing_in, written_to_tokens
from fxflops.capture.derived import TracedSize
from fxflops.errors import CaptureError

TOKENS = "image_tokens"
PIXELS = "image_pixel_values"
# names of the crop inputs' dims: images, crops per image (padded), each crop's pixels
CROP_DIMS = {PIXELS: {0: "images", 1: "crops", 3: "crop_height", 4: "crop_width"}, "image_attention_mask": {0: "images", 1: "crops"}}
_EMBEDDING_INPUTS = {"input_ids", "inputs_embeds", PIXELS, "image_sizes", "image_attention_mask"}


class ImageCrops(TokenEmbedding):
    """The crop handling of one model (see the module docstring), or :meth:`of` None."""

    TOKENS, INPUT, CONFIG, TOKEN_ID = TOKENS, PIXELS, "vision_config", "image_token_id"
    LEFT_OUT = "the per-image layout's elementwise work (the mask's row and column sums) and its backward"

    @staticmethod
    def is_owner(module: torch.nn.Module) -> bool:
        """An image embedding with Phi-4-multimodal's parts: ``get_img_features`` running its tower
        ``img_processor``, the two projections, and a forward taking the image-token ids, the embeddings and the crop inputs."""
        tower = callable(getattr(module, "get_img_features", None)) and isinstance(getattr(module, "img_processor", None), torch.nn.Module)
        return tower and has_parts(module, ("img_projection_up", "img_projection_down"), _EMBEDDING_INPUTS)

    @contextlib.contextmanager
    def capturing(self, model: torch.nn.Module, sizes: dict[str, TracedSize]) -> Iterator[None]:
        """While ``model`` (the capture's twin) is traced with the derived sizes ``sizes``: its image
        embedding on T rows, its feature embedding's image-token test True (see the module docstring)."""
        if TOKENS not in sizes:
            yield
            return
        owner = model.get_submodule(self.owner)

        def embed(input_ids: torch.Tensor, inputs_embeds: torch.Tensor, image_pixel_values: torch.Tensor,
                  image_sizes: object = None, image_attention_mask: object = None) -> torch.Tensor:
            tokens, ids = sizes[TOKENS]  # read while tracing: make_fx's own SymInt and tensor
            if input_ids is not ids or image_attention_mask is None:
                raise CaptureError(f"{type(owner).__name__} received input_ids other than the model's own, or no image_attention_mask")
            up = owner.img_projection_up.weight
            pixels = image_pixel_values.to(next(owner.img_processor.parameters()).dtype).flatten(0, 1)
            mask = image_attention_mask.flatten(0, 1).to(dtype=torch.bool, device=up.device)
            features = owner.get_img_features(pixels, attention_mask=mask)
            rows = features.reshape(-1, features.shape[-1])[:1].expand(tokens, features.shape[-1])
            projected = owner.img_projection_down(torch.nn.functional.gelu(owner.img_projection_up(rows.to(up.device, up.dtype))))
            return written_to_tokens(owner, inputs_embeds, projected, tokens)

        parent, feature_embedding = self.feature_embedding(model)
        with standing_in([(owner, "forward", embed), (parent, "forward", feature_embedding)]):
            yield
