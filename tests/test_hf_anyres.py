"""Anyres tiles counted symbolically (``fxflops/adapters/tiles.py``): LLaVA-NeXT and LLaVA-OneVision,
whose images are cut into a base tile and a grid of tiles chosen from each image's size.

Tiny random-weight models (batches built with ``test_hf_measured_families.py``'s helpers: 1-6 images
of mixed sizes per call, 1-3 right-padded sequences, text-only calls mixed in), eager and sdpa.
Reference per call: FlopCounterMode on the same batch through the eager model (its CPU SDPA count is
0, so sdpa is never the reference): forward per module, training per top-level module replayed alone
and the step's total. Every call counts through one program for the image calls, with the number of
tiles a free symbol, and nothing measured.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.adapters.tiles import AnyresTiles
from fxflops.errors import MetadataError
from fxflops.rules import entry_for
from fxflops.rules.not_counted import is_not_counted
from reference import assert_forward_per_module, assert_symbolic_in, assert_training_call_matches, flop_counter_modules, random_calls, with_attention
from test_hf_measured_families import IMAGE, TEXT, eager, owners_of, padded, sequences_with

pytest.importorskip("transformers")

# --- LLaVA-NeXT ---------------------------------------------------------------------------------

TILE = 32  # the vision towers' input size (px) in the anyres families
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # anyres grids: 1x2, 2x1, 2x2 tiles (+ the base tile)
SIZES = (20, 32, 50, 64)  # original image heights and widths (px)


def build_llava_next() -> torch.nn.Module:
    """CLIP tower on 32px tiles / patch 8 (16 patches + CLS, the second-to-last layer, CLS dropped),
    anyres grids up to 2x2 tiles with unpadding and image_newline; Llama text."""
    import transformers

    config = transformers.LlavaNextConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_hidden_layers=2, image_size=TILE, patch_size=8, projection_dim=32),
        text_config=dict(TEXT, model_type="llama"), image_token_index=IMAGE, image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-2, vision_feature_select_strategy="default")
    return eager(transformers.LlavaNextForConditionalGeneration, config)


def llava_next_batch(model, rng: random.Random, images: bool) -> dict:
    """1-6 images of random sizes (h, w in 20-64px), each its anyres tiles (base + grid) padded to the
    most tiles: pixel_values (images, tiles, 3, 32, 32), image_sizes (images, 2); each image's
    <image> tokens as many as its packed features (unpadded grid rows + newlines, base tile)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    batch = rng.randint(1, 3)
    sizes = [(rng.choice(SIZES), rng.choice(SIZES)) for _ in range(rng.randint(1, 6) if images else 0)]
    if not sizes:
        return sequences_with(rng, batch, [], [])
    tiles = [image_size_to_num_patches(size, PINPOINTS, TILE) for size in sizes]
    pixel_values = torch.randn(len(sizes), max(tiles), 3, TILE, TILE)
    image_sizes = torch.tensor(sizes)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values, image_sizes).pooler_output
    blocks = [[IMAGE] * f.shape[0] for f in features]
    call = sequences_with(rng, batch, blocks, owners_of(rng, batch, len(sizes)))
    return dict(call, pixel_values=pixel_values, image_sizes=image_sizes)


# --- LLaVA-OneVision -----------------------------------------------------------------------------


def build_llava_onevision() -> torch.nn.Module:
    """SigLIP tower on 32px tiles / patch 8 (16 tokens per tile, last layer, all tokens), anyres grids
    up to 2x2 tiles with unpadding and image_newline (anyres_max_1: a 2x2 grid is interpolated down);
    Qwen2 text."""
    import transformers

    config = transformers.LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, num_hidden_layers=2, image_size=TILE, patch_size=8,
                           vision_use_head=False),
        text_config=dict(TEXT, model_type="qwen2"), image_token_index=IMAGE, video_token_index=251,
        image_grid_pinpoints=PINPOINTS, vision_aspect_ratio="anyres_max_1")
    return eager(transformers.LlavaOnevisionForConditionalGeneration, config)


def llava_onevision_batch(model, rng: random.Random, images: bool) -> dict:
    """As LLaVA-NeXT, with batch_num_images (the images of each sequence): a sequence with one image
    gets its anyres tiles, one with several gets only their base tiles (the processor's rule)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    batch = rng.randint(1, 3)
    sizes = [(rng.choice(SIZES), rng.choice(SIZES)) for _ in range(rng.randint(1, 6) if images else 0)]
    if not sizes:
        return sequences_with(rng, batch, [], [])
    owners = owners_of(rng, batch, len(sizes))
    batch_num_images = [owners.count(b) for b in range(batch)]
    tiles = [image_size_to_num_patches(size, PINPOINTS, TILE) if batch_num_images[b] == 1 else 1
             for size, b in zip(sizes, owners)]
    pixel_values = torch.randn(len(sizes), max(tiles), 3, TILE, TILE)
    image_sizes = torch.tensor(sizes)
    extra = dict(image_sizes=image_sizes, batch_num_images=torch.tensor(batch_num_images))
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values, **extra).pooler_output
    call = sequences_with(rng, batch, [[IMAGE] * f.shape[0] for f in features], owners)
    return dict(call, pixel_values=pixel_values, **extra)


VIDEO = 251  # the video token (LLaVA-OneVision, LLaVA-NeXT-Video)


def llava_onevision_video_batch(model, rng: random.Random, images: bool) -> dict:
    """An image call (``images``) is one of: 1-2 videos alone (:func:`with_videos`), the same with
    1-6 images (``llava_onevision_batch``), or images alone."""
    kind = rng.choice(["videos", "images+videos", "images"]) if images else "text"
    return with_videos(model, rng, llava_onevision_batch(model, rng, kind.startswith("images")), kind)


def build_llava_next_video() -> torch.nn.Module:
    """LLaVA-NeXT's tower, grids and text, with LLaVA-NeXT-Video's 2x2 average pooling of each
    frame's features."""
    import transformers

    config = transformers.LlavaNextVideoConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_hidden_layers=2, image_size=TILE, patch_size=8, projection_dim=32),
        text_config=dict(TEXT, model_type="llama"), image_token_index=IMAGE, video_token_index=VIDEO,
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2, vision_feature_select_strategy="default",
        spatial_pool_stride=2)
    return eager(transformers.LlavaNextVideoForConditionalGeneration, config)


def with_videos(model, rng: random.Random, call: dict, kind: str) -> dict:
    """``call`` with 1-2 videos of 1, 2 or 4 frames (32px) when ``kind`` names videos: each video's
    <video> tokens as many as its features (from the model's own ``get_video_features``) at the end
    of a random sequence; pixel_values_videos (videos, frames, 3, 32, 32)."""
    if "videos" not in kind:
        return call
    videos = torch.randn(rng.randint(1, 2), rng.choice([1, 2, 4]), 3, TILE, TILE)
    with torch.no_grad():
        tokens = model.model.get_video_features(videos).pooler_output.shape[1]
    sequences = [ids[mask == 1].tolist() for ids, mask in zip(call["input_ids"], call["attention_mask"])]
    for owner in owners_of(rng, len(sequences), videos.shape[0]):
        sequences[owner] += [VIDEO] * tokens + [rng.randrange(50, 200)]
    ids, mask = padded(sequences)
    return dict(call, input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), pixel_values_videos=videos)


def llava_next_video_batch(model, rng: random.Random, images: bool) -> dict:
    """As :func:`llava_onevision_video_batch`, LLaVA-NeXT's images."""
    kind = rng.choice(["videos", "images+videos", "images"]) if images else "text"
    return with_videos(model, rng, llava_next_batch(model, rng, kind.startswith("images")), kind)


FAMILIES = {"llava_next": (build_llava_next, llava_next_batch), "llava_onevision": (build_llava_onevision, llava_onevision_batch)}
CALLS = 10
TEXT_ONLY = (3, 7)
TOP_LEVEL = ["model.vision_tower", "model.multi_modal_projector", "model.language_model", "lm_head"]


def calls(family: str, model: torch.nn.Module, seed: str, training: bool) -> list[dict]:
    return random_calls(lambda rng, images: FAMILIES[family][1](model, rng, images), seed, training, CALLS, TEXT_ONLY)


def check_symbolic(wrapper) -> None:
    """One program for every image call, in the number of tiles; nothing measured or uncounted."""
    assert_symbolic_in(wrapper, "tiles")


@pytest.mark.parametrize(
    ("family", "attn"),
    [(f, "eager") for f in FAMILIES] + [pytest.param(f, "sdpa", marks=pytest.mark.long) for f in FAMILIES],
)
def test_forward_counts_equal_flop_counter_per_module(family, attn):
    reference = FAMILIES[family][0]()
    wrapper = fxflops.instrument(with_attention(reference, attn), strict=True)
    assert_forward_per_module(wrapper, reference, calls(family, reference, f"{family}-forward", training=False), (family, attn))
    check_symbolic(wrapper)


@pytest.mark.long
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_counts_equal_flop_counter_per_top_level_module(family, attn):
    reference = FAMILIES[family][0]()
    wrapper = fxflops.instrument(with_attention(reference, attn), backward=True, strict=True)
    wrapper.train()
    for i, batch in enumerate(calls(family, reference, f"{family}-training", training=True)):
        paths = TOP_LEVEL if "pixel_values" in batch else TOP_LEVEL[2:]
        _, _, forward, training = assert_training_call_matches(wrapper, reference, batch, paths, (family, attn, i))
        assert training[""] > 2 * forward[""] > 0
    check_symbolic(wrapper)


@pytest.mark.long  # 20 s: the default suite stays under 10 minutes on 2 cores
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_onevision_videos_count_symbolically_in_videos_and_frames(attn):
    """LLaVA-OneVision's videos (videos, frames, C, H, W), alone or with images, 1-2 videos of 1-4
    frames: forward per module equal FlopCounterMode, programs in ``videos`` and ``video_frames``
    per layout (videos alone, with images), and per side of the guard videos·frames = 1 that the
    model's own ``apply_pooling`` view makes (one video of one frame); nothing measured."""
    reference = build_llava_onevision()
    wrapper = fxflops.instrument(with_attention(reference, attn), strict=True)
    batches = random_calls(lambda rng, images: llava_onevision_video_batch(reference, rng, images), "onevision-videos", False, 10, (5,))
    assert {v.shape[0] for b in batches if "pixel_values_videos" in b for v in [b["pixel_values_videos"]]} == {1, 2}
    assert_forward_per_module(wrapper, reference, batches, ("onevision-videos", attn))
    videos = [p for p in wrapper.programs if "video_frames" in map(str, p.all_symbols)]
    assert 1 <= len(videos) <= 4 and all({"videos", "video_frames"} <= set(map(str, p.symbols)) for p in videos)
    assert wrapper.measured == {} and wrapper.flops.uncounted == 0 and wrapper.captures <= 6


@pytest.mark.long
def test_onevision_video_training_counts_equal_flop_counter_per_top_level_module():
    reference = build_llava_onevision()
    wrapper = fxflops.instrument(reference, backward=True, strict=True)
    wrapper.train()
    batches = random_calls(lambda rng, images: llava_onevision_video_batch(reference, rng, images), "onevision-video-training", True, 10, (5,))
    for i, batch in enumerate(batches):
        paths = TOP_LEVEL if "pixel_values" in batch or "pixel_values_videos" in batch else TOP_LEVEL[2:]
        assert_training_call_matches(wrapper, reference, batch, paths, ("onevision-videos", i))
    assert wrapper.measured == {} and wrapper.flops.uncounted == 0


@pytest.mark.long
def test_llava_next_video_counts_exactly_per_video_shape():
    """LLaVA-NeXT-Video's forward cuts the video features per video in Python and makes a tensor of
    their lengths (``torch.tensor([feature.size(0) for ...])``), which fixes the videos' sizes in the
    trace: a video call is counted by a program of its video shape (captured again for another),
    exactly; the images count in tiles as LLaVA-NeXT's. Forward per module equals FlopCounterMode."""
    reference = build_llava_next_video()
    wrapper = fxflops.instrument(reference, strict=True)
    batches = random_calls(lambda rng, images: llava_next_video_batch(reference, rng, images), "next-video", False, 10, (5,))
    assert_forward_per_module(wrapper, reference, batches, "llava_next_video")
    assert wrapper.measured == {} and wrapper.flops.uncounted == 0


def test_the_model_computes_what_it_computes_unpacked():
    """The model given the tiles packed (what it runs under fxflops) returns what it returns from the
    processor's padded pixel_values, and the user's tensors are not changed."""
    model = build_llava_next()
    batch = llava_next_batch(model, random.Random(3), images=True)
    del batch["labels"]
    pixels = batch["pixel_values"].clone()
    with torch.no_grad():
        plain = model(**batch).logits
        counted = fxflops.instrument(model, strict=True)(**batch).logits
    assert torch.equal(plain, counted) and torch.equal(batch["pixel_values"], pixels)


def test_tiles_packed_by_the_caller_and_positional_pixels_count_the_same():
    """pixel_values given as (tiles, C, H, W) already (a form the model takes), or positionally: the
    same count as the padded call, from the same program."""
    model = build_llava_next()
    wrapper = fxflops.instrument(model, strict=True)
    batch = llava_next_batch(model, random.Random(5), images=True)
    del batch["labels"]
    expected = flop_counter_modules(model, batch, backward=False)[""]
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    counts = [image_size_to_num_patches(size, PINPOINTS, TILE) for size in batch["image_sizes"].tolist()]
    packed = dict(batch, pixel_values=torch.cat([p[:n] for p, n in zip(batch["pixel_values"], counts)]))
    positional = {k: v for k, v in batch.items() if k not in ("input_ids", "pixel_values")}
    for label, args, kwargs in [("padded", (), batch), ("packed", (), packed),
                                ("positional", (batch["input_ids"], batch["pixel_values"]), positional)]:
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(*args, **kwargs)
        assert wrapper.flops.total() == expected, label
    assert wrapper.captures == 1


def test_image_sizes_that_do_not_fit_the_pixels_are_named():
    """An image asking for more tiles than the padding holds, or image_sizes for another number of
    images: a MetadataError naming both inputs (strict), else an uncounted call, never a count."""
    model = build_llava_next()
    batch = llava_next_batch(model, random.Random(3), images=True)
    del batch["labels"]
    too_few_tiles = dict(batch, pixel_values=batch["pixel_values"][:, :1])
    other_images = dict(batch, image_sizes=torch.cat([batch["image_sizes"], batch["image_sizes"][:1]]))
    for bad in (too_few_tiles, other_images):
        with pytest.raises(MetadataError, match="image_sizes.*pixel_values"):
            fxflops.instrument(model, strict=True)(**bad)
        wrapper = fxflops.instrument(model)
        with pytest.warns(UserWarning, match="image_sizes"), torch.no_grad():
            try:
                wrapper(**bad)  # the model's own error, if it raises one, is the model's
            except Exception as exc:  # noqa: BLE001
                assert "fxflops" not in type(exc).__module__
        assert wrapper.flops.total() == 0


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_per_image_packing_left_out_of_the_trace_does_no_counted_work(family):
    """The trace keeps ``pack_image_features``' one packed piece instead of running it per image: that
    is exact only because it does no work fxflops counts under any convention (views, unpadding slices,
    the newline concatenated, OneVision's resize). Run on random features of 1-6 images of every size
    here, forward and backward: FlopCounterMode counts 0, and every op is one fxflops counts under no
    convention (no rule, and not pointwise or reduction work: those are counted by ``count="all"``)."""
    model = FAMILIES[family][0]()
    base, tiles = model.model, AnyresTiles.of(model, inspect.signature(model.forward))
    options = {"vision_feature_select_strategy": model.config.vision_feature_select_strategy,
               "vision_aspect_ratio": getattr(model.config, "vision_aspect_ratio", None)}
    options = {k: v for k, v in options.items() if k in inspect.signature(base.pack_image_features).parameters}
    rng = random.Random(family)
    for _ in range(6):
        sizes = [(rng.choice((20, 32, 50, 64)), rng.choice((20, 32, 50, 64))) for _ in range(rng.randint(1, 6))]
        features = [torch.randn(n, (TILE // 8) ** 2, 64, requires_grad=True) for n in tiles.tiles_per_image(sizes)]
        recorded = _Ops()
        with FlopCounterMode(display=False) as counter:
            with recorded:
                packed, _ = base.pack_image_features(features, torch.tensor(sizes), image_newline=base.image_newline, **options)
            out = torch.cat(packed)
            gradient = torch.randn_like(out)
            with recorded:
                out.backward(gradient)
        assert counter.get_total_flops() == 0
        counted = {str(op) for op in recorded.ops if entry_for(op) is not None or (
            not is_not_counted(op) and {torch.Tag.pointwise, torch.Tag.reduction} & set(getattr(op, "tags", ())))}
        assert not counted, (family, sizes, counted)
