"""Tiny Hugging Face VLMs with random weights (no hub access) and random batches for them.

Each factory builds a real ``transformers`` model from a tiny config (2 text layers, 2 vision layers,
hidden 64) with ``attn_implementation`` "eager" or "sdpa"; :func:`random_batch` draws a microbatch the
way the family's processor lays it out: per sequence some images (and videos where the family has
them) of random resolution, each as ``<start> <image token> x n <end>``, random text around them,
right padding with ``attention_mask`` 0 and ``labels`` -100. Used by the tests and by
``benchmarks/hf_models.py``; ``fxflops report fxflops.models.hf_zoo:qwen2_vl`` shows one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

VOCAB = 256
IMAGE, VIDEO, START, END, PAD = 250, 251, 252, 253, 0
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=PAD)


@dataclass(frozen=True)
class Family:
    """How to build one family's tiny model and lay out its batches."""

    name: str
    build: Callable[[str, int, int], torch.nn.Module]  # (attn_implementation, text layers, vision layers)
    layout: str  # "grid": packed patches with image_grid_thw; "fixed": pixel_values (images, 3, H, W)
    videos: bool = False
    frames_apart: bool = False  # each video frame its own <start> ... <end> group after a timestamp


QWEN_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
MROPE = {"rope_type": "default", "mrope_section": [2, 2, 4]}  # sections of head_dim / 2 = 8


def _qwen2_vl(attn: str, text_layers: int, vision_layers: int) -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(TEXT, num_hidden_layers=text_layers, rope_parameters=MROPE),
        vision_config=dict(depth=vision_layers, embed_dim=32, hidden_size=64, num_heads=4, in_chans=3, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2),
        **QWEN_TOKENS,
    )
    return _build(Qwen2VLForConditionalGeneration, config, attn)


def _qwen2_5_vl(attn: str, text_layers: int, vision_layers: int) -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT, num_hidden_layers=text_layers, rope_parameters=MROPE),
        vision_config=dict(depth=vision_layers, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=4,
                           in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[vision_layers - 1]),
        **QWEN_TOKENS,
    )
    return _build(Qwen2_5_VLForConditionalGeneration, config, attn)


def _qwen3_vl(moe: bool) -> Callable[[str, int, int], torch.nn.Module]:
    """Qwen3-VL (deepstack, interpolated position table), with a mixture-of-experts text model if ``moe``."""

    def build(attn: str, text_layers: int, vision_layers: int) -> torch.nn.Module:
        import transformers

        prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1) if moe else {}
        config = getattr(transformers, f"{prefix}Config")(
            text_config=dict(TEXT, num_hidden_layers=text_layers, head_dim=16, **experts,
                             rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
            vision_config=dict(depth=vision_layers, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=4,
                               in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                               num_position_embeddings=64, deepstack_visual_indexes=[0]),
            **QWEN_TOKENS,
        )
        return _build(getattr(transformers, f"{prefix}ForConditionalGeneration"), config, attn)

    return build


TOWERS = {  # 32x32 images in 8x8 patches: 16 patch tokens (+ CLS for CLIP)
    "clip": dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 image_size=32, patch_size=8, projection_dim=32),
    "siglip": dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   image_size=32, patch_size=8),
}


def _llava(tower: str) -> Callable[[str, int, int], torch.nn.Module]:
    def build(attn: str, text_layers: int, vision_layers: int) -> torch.nn.Module:
        from transformers import LlavaConfig, LlavaForConditionalGeneration

        config = LlavaConfig(
            vision_config=dict(TOWERS[tower], num_hidden_layers=vision_layers),
            text_config=dict(TEXT, model_type="llama", num_hidden_layers=text_layers),
            image_token_id=IMAGE, image_seq_length=16,
            # LLaVA drops CLIP's CLS token from the penultimate layer; SigLIP towers have none
            vision_feature_select_strategy="default" if tower == "clip" else "full",
            vision_feature_layer=-2 if tower == "clip" else -1,
        )
        return _build(LlavaForConditionalGeneration, config, attn)

    return build


def _gemma3(attn: str, text_layers: int, vision_layers: int) -> torch.nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        vision_config=dict(TOWERS["siglip"], num_hidden_layers=vision_layers, patch_size=4),  # 64 patches
        text_config=dict(TEXT, num_hidden_layers=text_layers, head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"] * (text_layers // 2) + ["sliding_attention"] * (text_layers % 2)),
        mm_tokens_per_image=16,  # the projector average-pools 8x8 patches to 4x4 tokens
        image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END,
    )
    return _build(Gemma3ForConditionalGeneration, config, attn)


def _build(cls: Any, config: Any, attn: str) -> torch.nn.Module:
    config._attn_implementation = attn
    config._experts_implementation = "eager"  # the loop over experts, which FlopCounterMode counts
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config).eval()


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family("qwen2_vl", _qwen2_vl, "grid", videos=True),
    "qwen2_5_vl": Family("qwen2_5_vl", _qwen2_5_vl, "grid", videos=True),
    "qwen3_vl": Family("qwen3_vl", _qwen3_vl(moe=False), "grid", videos=True, frames_apart=True),
    "qwen3_vl_moe": Family("qwen3_vl_moe", _qwen3_vl(moe=True), "grid", videos=True, frames_apart=True),
    "llava_clip": Family("llava_clip", _llava("clip"), "fixed"),
    "llava_siglip": Family("llava_siglip", _llava("siglip"), "fixed"),
    "gemma3": Family("gemma3", _gemma3, "fixed"),
}


def build(family: str, attn: str = "eager", text_layers: int = 2, vision_layers: int = 2) -> torch.nn.Module:
    """The tiny model of ``family`` (a key of :data:`FAMILIES`)."""
    return FAMILIES[family].build(attn, text_layers, vision_layers)


def random_batch(
    family: str, rng: random.Random, images: int | None = None, batch: int | None = None, videos: int = 0
) -> dict[str, Any]:
    """A random microbatch for ``family``: 1-6 images (and ``videos`` videos), 1-3 sequences, right
    padding. The call's layout (which arguments it has) depends only on ``videos`` being 0 or not."""
    spec = FAMILIES[family]
    batch = batch or rng.randint(1, 3)
    images = images if images is not None else rng.randint(1, 6)
    if videos and not spec.videos:
        raise ValueError(f"{family} takes no videos")
    kinds = ["image"] * images + ["video"] * videos
    rng.shuffle(kinds)
    owner = [rng.randrange(batch) for _ in kinds]
    if spec.layout == "grid":
        return _grid_batch(rng, batch, kinds, owner, spec.frames_apart)
    return _fixed_batch(spec, rng, batch, owner)


def _fixed_batch(spec: Family, rng: random.Random, batch: int, owner: list[int]) -> dict[str, Any]:
    """LLaVA/Gemma-style: ``pixel_values`` (images, 3, 32, 32), 16 image tokens per image; Gemma 3
    brackets them with begin/end-of-image tokens and marks them in ``token_type_ids`` (its image
    tokens attend to each other bidirectionally in training)."""
    sequences = [[] for _ in range(batch)]
    bracket = spec.name == "gemma3"
    for seq in owner:
        sequences[seq] += [rng.randrange(1, 200) for _ in range(rng.randint(0, 5))]
        sequences[seq] += [START] * bracket + [IMAGE] * 16 + [END] * bracket
    for seq in sequences:
        seq += [rng.randrange(1, 200) for _ in range(rng.randint(1, 8))]
    length = max(map(len, sequences))
    ids = torch.tensor([seq + [PAD] * (length - len(seq)) for seq in sequences])
    mask = torch.tensor([[1] * len(seq) + [0] * (length - len(seq)) for seq in sequences])
    call: dict[str, Any] = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                                pixel_values=torch.randn(len(owner), 3, 32, 32))
    if bracket:
        call["token_type_ids"] = (ids == IMAGE).long()
    return call


def _grid_batch(rng: random.Random, batch: int, kinds: list[str], owner: list[int], frames_apart: bool) -> dict[str, Any]:
    """Qwen-style: packed patches ``(Σ t·h·w, 3·2·4·4)`` with ``(t, h, w)`` per image or video
    (``t`` = frames / temporal patch 2; ``h``, ``w`` in patches, even for the 2x2 merge; an image has at
    least 2 merged tokens: with a single 1-token image in the batch, torch's ``index_put`` would
    broadcast that one row, a different branch that gets a program of its own)."""
    media = []  # (kind, grid) in order of appearance
    for kind in kinds:
        if kind == "video":
            media.append(("video", (rng.randint(2, 3), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3))))
        else:
            # at least 2 merged tokens: a lone 1-token image makes index_put broadcast (its own program)
            media.append(("image", (1, 2 * rng.randint(1, 4), 2 * rng.randint(2, 4))))
    sequences = [[] for _ in range(batch)]
    for (kind, (t, h, w)), seq in zip(media, owner):
        sequences[seq] += [rng.randrange(1, 200) for _ in range(rng.randint(0, 5))]
        if kind == "video" and frames_apart:  # Qwen3-VL: "<t seconds>" text, then the frame's tokens
            for _ in range(t):
                sequences[seq] += [rng.randrange(1, 200) for _ in range(2)] + [START] + [VIDEO] * (h * w // 4) + [END]
        else:
            sequences[seq] += [START] + [IMAGE if kind == "image" else VIDEO] * (t * h * w // 4) + [END]
    for seq in sequences:
        seq += [rng.randrange(1, 200) for _ in range(rng.randint(1, 8))]
    length = max(map(len, sequences))
    ids = torch.tensor([seq + [PAD] * (length - len(seq)) for seq in sequences])
    mask = torch.tensor([[1] * len(seq) + [0] * (length - len(seq)) for seq in sequences])
    call: dict[str, Any] = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                                mm_token_type_ids=(ids == IMAGE).long() + 2 * (ids == VIDEO).long())
    # the processor orders media by sequence, then position: the order the tokens appear in
    order = sorted(range(len(media)), key=lambda i: (owner[i], i))
    for kind in ("image", "video"):
        grids = [media[i][1] for i in order if media[i][0] == kind]
        if grids:
            pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4)
            call["pixel_values" if kind == "image" else "pixel_values_videos"] = pixels
            call[f"{kind}_grid_thw"] = torch.tensor(grids)
    return call
