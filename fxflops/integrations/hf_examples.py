"""Example calls of a transformers model from its config alone (planning without weights or a
processor: ``fxflops report config.json --image 448x448``).

A VLM's call is laid out as its processor lays it out, from the config's own fields:

- **grid** (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: a vision config with ``spatial_merge_size`` and
  ``temporal_patch_size``): an image of W x H pixels is rounded to the nearest multiple of
  ``patch_size · spatial_merge_size`` on each side (at least one), giving the grid
  ``(1, H' / patch, W' / patch)``, ``t·h·w`` packed patch rows of ``channels · temporal_patch ·
  patch²`` values and ``h·w / merge²`` image tokens between the vision start and end tokens. The
  processor's min/max-pixel rescaling is not applied: give the size it produces.
- **fixed** (LLaVA, Gemma 3: a vision config with ``image_size``): every image is resized to
  ``image_size²`` by the processor (another ``--image`` size is refused), ``pixel_values`` is
  ``(images, channels, S, S)`` and each image is ``image_seq_length`` (LLaVA) or
  ``mm_tokens_per_image`` (Gemma 3, between its begin/end-of-image tokens) image tokens.

Other layouts (LLaVA-NeXT's tiles, Idefics' splits) raise ``ValueError``. Text tokens are 1 (no
padding), images follow the text in one sequence; ``labels`` are the ids (a training step).
"""

from __future__ import annotations

from typing import Any

import torch

TEXT_TOKEN = 1  # an ordinary token id of every vocabulary


def example_call(config: Any, images: list[tuple[int, int]], text_tokens: int = 16) -> dict[str, torch.Tensor]:
    """The keyword arguments of one training call: one sequence of ``text_tokens`` text tokens and
    the ``images`` (width, height) in pixels, laid out as described in the module docstring."""
    if not images:
        ids = torch.full((1, text_tokens), TEXT_TOKEN, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}
    vision = getattr(config, "vision_config", None)
    if vision is None:
        raise ValueError(f"{type(config).__name__} has no vision_config: it takes no images")
    if getattr(vision, "spatial_merge_size", None) and getattr(vision, "temporal_patch_size", None):
        return _grid_call(config, vision, images, text_tokens)
    if getattr(vision, "image_size", None) and not getattr(config, "image_grid_pinpoints", None):  # not tiled (anyres)
        return _fixed_call(config, vision, images, text_tokens)
    raise ValueError(
        f"{type(config).__name__}: fxflops cannot lay out its images without the processor (it knows the grid "
        "layout of Qwen-VL models and fixed-resolution towers such as LLaVA's and Gemma 3's)"
    )


def _grid_call(config: Any, vision: Any, images: list[tuple[int, int]], text_tokens: int) -> dict[str, torch.Tensor]:
    patch, merge, temporal = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    factor = patch * merge
    grids = [(1, _rounded(height, factor) // patch, _rounded(width, factor) // patch) for width, height in images]
    ids = [TEXT_TOKEN] * text_tokens
    for t, h, w in grids:
        ids += [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // merge**2) + [config.vision_end_token_id]
    input_ids = torch.tensor([ids])
    rows = sum(t * h * w for t, h, w in grids)
    return {
        "input_ids": input_ids,
        "labels": input_ids,
        "mm_token_type_ids": (input_ids == config.image_token_id).long(),
        "pixel_values": torch.zeros(rows, _channels(vision) * temporal * patch**2),
        "image_grid_thw": torch.tensor(grids),
    }


def _fixed_call(config: Any, vision: Any, images: list[tuple[int, int]], text_tokens: int) -> dict[str, torch.Tensor]:
    size = vision.image_size
    if any((width, height) != (size, size) for width, height in images):
        raise ValueError(f"{type(config).__name__}'s processor resizes every image to {size}x{size}: give --image {size}x{size}")
    per_image = getattr(config, "image_seq_length", None) or getattr(config, "mm_tokens_per_image", None)
    if not per_image:
        raise ValueError(f"{type(config).__name__}: the config gives no number of tokens per image")
    begin, end = getattr(config, "boi_token_index", None), getattr(config, "eoi_token_index", None)
    ids = [TEXT_TOKEN] * text_tokens
    for _ in images:
        ids += [begin] * (begin is not None) + [config.image_token_id] * per_image + [end] * (end is not None)
    input_ids = torch.tensor([ids])
    call = {
        "input_ids": input_ids,
        "labels": input_ids,
        "pixel_values": torch.zeros(len(images), _channels(vision), size, size),
    }
    if begin is not None:  # Gemma 3 marks its image tokens (bidirectional attention among them)
        call["token_type_ids"] = (input_ids == config.image_token_id).long()
    return call


def _rounded(pixels: int, factor: int) -> int:
    """``pixels`` to the nearest multiple of ``factor``, at least ``factor`` (Qwen's processor rounding)."""
    return max(factor, round(pixels / factor) * factor)


def _channels(vision: Any) -> int:
    for name in ("in_channels", "in_chans", "num_channels"):
        if getattr(vision, name, None):
            return getattr(vision, name)
    return 3
