"""Hugging Face VLM families whose symbolic capture fails inside a module (data-dependent Python
code: loops over ``image_sizes``, ``.tolist()`` splits, ``if mask.any():``), counted exactly all the
same by measured islands (``fxflops/islands.py``): Ovis2 and Emu3 (VQ-VAE image tokenizer).
Mistral 3 counts symbolically (``test_hf_patch_grids.py``), and so do Idefics2, Idefics3 and
SmolVLM (``test_hf_frames.py``) and Phi-4-multimodal's images (``test_hf_crops.py``) and audio
(``test_hf_audio.py``), whose builders live here.

Each family is a tiny random-weight model built here with ``attn_implementation="eager"`` (attention
as explicit matmuls, which FlopCounterMode counts) and called on random microbatches laid out as its
processor would: 1-6 images of mixed sizes (tiles, crops, padding) where the family allows, 1-3
sequences of random lengths, right padding (attention_mask 0), some text-only calls mixed in. The
number of image tokens of each image is what the model expects, computed on the concrete inputs as
the processor would (from the model's own ``get_image_features`` where the processor's formula is
not simpler). Reference per call: FlopCounterMode on the same model and batch, forward-only (total
and every module) and forward + ``loss.backward()`` (totals only: FlopCounterMode's per-module
backward attribution is a heuristic). Every image call is measured in the module whose own code is
data-dependent (``wrapper.measured``) and nothing is left uncounted.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import fxflops
from reference import degrouped, flop_counter_modules

CALLS = 10  # random calls per family and test
VOCAB, PAD, IMAGE, START, END = 256, 0, 250, 252, 253  # text tokens are drawn from 50-199
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=PAD)
TEXT_ONLY = (2, 6)  # the calls (of CALLS) without pixel_values: every family here supports them


def eager(cls, config) -> torch.nn.Module:
    config._attn_implementation = "eager"
    for sub in ("text_config", "vision_config", "vq_config", "audio_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).eval()


def words(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(50, 200) for _ in range(rng.randint(low, high))]


def padded(sequences: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding: (ids, attention mask)."""
    length = max(map(len, sequences))
    ids = torch.tensor([seq + [pad] * (length - len(seq)) for seq in sequences])
    mask = torch.tensor([[1] * len(seq) + [0] * (length - len(seq)) for seq in sequences])
    return ids, mask


def sequences_with(rng: random.Random, batch: int, blocks: list[list[int]], owners: list[int]) -> dict:
    """``batch`` sequences: 1-3 text tokens, then each image's token block (in ``blocks``' order, which
    is pixel_values' order: ``owners`` is sorted) in its owner sequence after 0-3 text tokens, then
    1-6 text tokens; right padded, labels the ids (-100 at padding)."""
    assert owners == sorted(owners)
    sequences = [words(rng, 1, 3) for _ in range(batch)]
    for block, owner in zip(blocks, owners):
        sequences[owner] += words(rng, 0, 3) + block
    ids, mask = padded([seq + words(rng, 1, 6) for seq in sequences])
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def owners_of(rng: random.Random, batch: int, images: int) -> list[int]:
    return sorted(rng.randrange(batch) for _ in range(images))


# --- Idefics3 / SmolVLM ------------------------------------------------------------------------

FRAME = 32  # Idefics3 / SmolVLM frames: 32px, patch 8, pixel shuffle 2: 4 tokens per frame
FRAME_TOKENS = 4
ROW_COL, NEWLINE, GLOBAL = 30, 10, 29  # <row_i_col_j> (30 + 2i + j), "\n", <global-img>


def build_idefics3(cls_name: str = "Idefics3") -> torch.nn.Module:
    """SigLIP-style tower on 32px frames / patch 8 with a patch attention mask (bucketized position
    ids), pixel shuffle 2 + linear: 4 tokens per frame; Llama text."""
    import transformers

    config = getattr(transformers, f"{cls_name}Config")(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                           image_size=FRAME, patch_size=8),
        text_config=dict(TEXT, model_type="llama"), image_token_id=IMAGE, scale_factor=2, pad_token_id=PAD)
    return eager(getattr(transformers, f"{cls_name}ForConditionalGeneration"), config)


def frames_tokens(rows: int, cols: int) -> list[int]:
    """Idefics3's prompt of an image of rows x cols frames + the global frame (rows = cols = 0: the
    global frame alone): <fake> <row_i_col_j> <image> x 4 per frame, "\n" after each row, then
    "\n" <fake> <global-img> <image> x 4 <fake>."""
    out = []
    for i in range(rows):
        for j in range(cols):
            out += [START, ROW_COL + 2 * i + j] + [IMAGE] * FRAME_TOKENS
        out += [NEWLINE]
    return out + [NEWLINE, START, GLOBAL] + [IMAGE] * FRAME_TOKENS + [START]


def idefics3_batch(model, rng: random.Random, images: bool) -> dict:
    """1-6 frames in all: images split into rows x cols frames + a global one (1x2, 2x1) or a global
    frame alone, each in a random one of 1-3 sequences; pixel_values (sequences, most frames, 3, 32,
    32) with all-zero padding frames (the model drops them), pixel_attention_mask marking each frame's
    valid pixels (a global frame of a non-square image is padded: rows or columns of patches off)."""
    batch = rng.randint(1, 3)
    per_sequence: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
    left = rng.randint(1, 6) if images else 0
    while left:
        grid = rng.choice([g for g in [(0, 0), (1, 2), (2, 1)] if g[0] * g[1] + 1 <= left])
        per_sequence[rng.randrange(batch)].append(grid)
        left -= grid[0] * grid[1] + 1
    blocks = [frames_tokens(*grid) for grids in per_sequence for grid in grids]
    owners = [b for b, grids in enumerate(per_sequence) for _ in grids]
    call = sequences_with(rng, batch, blocks, owners)
    frames = [sum(r * c + 1 for r, c in grids) for grids in per_sequence]
    if not sum(frames):
        return call
    pixel_values = torch.zeros(batch, max(frames), 3, FRAME, FRAME)
    mask = torch.zeros(batch, max(frames), FRAME, FRAME, dtype=torch.long)
    for b, grids in enumerate(per_sequence):
        k = 0
        for rows, cols in grids:
            for _ in range(rows * cols):  # full tiles
                pixel_values[b, k] = torch.randn(3, FRAME, FRAME)
                mask[b, k] = 1
                k += 1
            h, w = rng.choice([(FRAME, FRAME), (FRAME, FRAME // 2), (3 * FRAME // 4, FRAME)])  # the global frame
            pixel_values[b, k, :, :h, :w] = torch.randn(3, h, w)
            mask[b, k, :h, :w] = 1
            k += 1
    return dict(call, pixel_values=pixel_values, pixel_attention_mask=mask)


def build_smolvlm() -> torch.nn.Module:
    """Idefics3's layout (SmolVLM's classes): 4 tokens per 32px frame; Llama text."""
    return build_idefics3("SmolVLM")


IDEFICS2_LATENTS = 4  # the perceiver's latents: tokens per frame, whatever the frame's valid pixels


def build_idefics2() -> torch.nn.Module:
    """Idefics2: the SigLIP-style tower on 32px frames / patch 8 with a patch attention mask, a
    connector of MLP + perceiver resampler (2 layers of cross-attention from 4 latents to the frame's
    patches and themselves, masked by the patch mask); Mistral text."""
    import transformers

    config = transformers.Idefics2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                           image_size=FRAME, patch_size=8),
        perceiver_config=dict(hidden_act="silu", resampler_n_latents=IDEFICS2_LATENTS, resampler_depth=2, resampler_n_heads=4,
                              resampler_head_dim=8, num_key_value_heads=2, hidden_size=TEXT["hidden_size"]),
        text_config=dict(TEXT, model_type="mistral"), image_token_id=IMAGE)
    return eager(transformers.Idefics2ForConditionalGeneration, config)


def idefics2_batch(model, rng: random.Random, images: bool) -> dict:
    """1-6 frames in all (the processor without image splitting: one frame per image), each in a
    random one of 1-3 sequences as <fake> <image> x 4 <fake>; pixel_values (sequences, most frames,
    3, 32, 32) with all-zero padding frames, pixel_attention_mask marking each frame's valid pixels
    (a non-square image is padded to the frame: rows or columns of patches off)."""
    batch = rng.randint(1, 3)
    owners = owners_of(rng, batch, rng.randint(1, 6) if images else 0)
    call = sequences_with(rng, batch, [[START] + [IMAGE] * IDEFICS2_LATENTS + [START] for _ in owners], owners)
    if not owners:
        return call
    frames = [owners.count(b) for b in range(batch)]
    pixel_values = torch.zeros(batch, max(frames), 3, FRAME, FRAME)
    mask = torch.zeros(batch, max(frames), FRAME, FRAME, dtype=torch.long)
    for b in range(batch):
        for k in range(frames[b]):
            h, w = rng.choice([(FRAME, FRAME), (FRAME, FRAME // 2), (3 * FRAME // 4, FRAME)])
            pixel_values[b, k, :, :h, :w] = torch.randn(3, h, w)
            mask[b, k, :h, :w] = 1
    return dict(call, pixel_values=pixel_values, pixel_attention_mask=mask)


# --- Ovis2 ----------------------------------------------------------------------------------------

OVIS_INDICATORS = (41, 42, 43, 44, 45)  # <IMG_START> <IMG_GRID> <IMG_COL> <IMG_ROW> <IMG_END>
OVIS_TOKENS = 4  # 32px crops, patch 8, hidden stride 2


def build_ovis2() -> torch.nn.Module:
    """Ovis2 visual tokenizer (RMSNorm ViT on 32px crops / patch 8, hidden stride 2: 4 tokens per crop,
    a 64-word visual vocabulary, softmax), visual embedding table; Qwen2 text."""
    import transformers

    config = transformers.Ovis2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                           image_size=32, patch_size=8, hidden_stride=2, vocab_size=64, num_visual_indicator_tokens=5),
        text_config=dict(TEXT, model_type="qwen2"), image_token_id=IMAGE, visual_indicator_token_ids=OVIS_INDICATORS,
        vocab_size=VOCAB, hidden_size=TEXT["hidden_size"])
    return eager(transformers.Ovis2ForConditionalGeneration, config)


def ovis2_tokens(rows: int, cols: int) -> list[int]:
    """<IMG_START> <image> x 4 (the global crop) <IMG_GRID>, then for a split image the crops' <image>
    x 4 separated by <IMG_COL> in a row, rows by <IMG_ROW>; <IMG_END>."""
    start, grid, col, row, end = OVIS_INDICATORS
    out = [start] + [IMAGE] * OVIS_TOKENS + [grid]
    if rows * cols > 1:
        for r in range(rows):
            for c in range(cols):
                out += [IMAGE] * OVIS_TOKENS + ([col] if c < cols - 1 else [])
            out += [row] if r < rows - 1 else []
    return out + [end]


def ovis2_batch(model, rng: random.Random, images: bool) -> dict:
    """1-6 crops in all: images of grids 1x1 (the global crop alone), 1x2, 2x1, 2x2 (+ the global crop),
    each in a random one of 1-3 sequences; pixel_values (crops, 3, 32, 32)."""
    batch = rng.randint(1, 3)
    grids = []
    left = rng.randint(1, 6) if images else 0
    while left:
        grid = rng.choice([g for g in [(1, 1), (1, 2), (2, 1), (2, 2)] if (g[0] * g[1] + 1 if g != (1, 1) else 1) <= left])
        grids.append(grid)
        left -= grid[0] * grid[1] + 1 if grid != (1, 1) else 1
    call = sequences_with(rng, batch, [ovis2_tokens(*g) for g in grids], owners_of(rng, batch, len(grids)))
    crops = sum(r * c + 1 if r * c > 1 else 1 for r, c in grids)
    if crops:
        call["pixel_values"] = torch.randn(crops, 3, 32, 32)
    return call


# --- Phi-4-multimodal -------------------------------------------------------------------------------

PHI4_CROP, PHI4_PATCH = 32, 8  # 4x4 patches per crop, 2x2 average pooled: 4 tokens per crop
PHI4_IMAGE = 250


def build_phi4_multimodal() -> torch.nn.Module:
    """SigLIP-style tower on 32px crops / patch 8 with a patch attention mask, 2x2 average pooling,
    global + sub-crop features with separators, 2-layer projection; Phi-3 text (fused qkv / gate_up);
    a tiny conformer audio encoder (``phi4_audio_batch``: ``test_hf_audio.py``)."""
    import transformers

    config = transformers.Phi4MultimodalConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, original_max_position_embeddings=1024, pad_token_id=PAD,
        bos_token_id=1, eos_token_id=2,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                           image_size=PHI4_CROP, patch_size=PHI4_PATCH, crop_size=PHI4_CROP, image_token_id=PHI4_IMAGE,
                           feature_layer=-2),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=4,
                          ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32,
                          input_size=16, audio_token_id=251))
    return eager(transformers.Phi4MultimodalForCausalLM, config)


def phi4_batch(model, rng: random.Random, images: bool) -> dict:
    """1-4 images, each resized to a grid of rows x cols 32px crops (1-2 each, at most 3 crops in a
    grid) with its right or bottom patches padding (the processor's attention mask), + the global
    crop, padded to the most crops (all-zero crops and masks); image_sizes the grids' pixel sizes;
    <image> x (global 2x(2+1) + 1 separator + useful rows x (useful cols + 1)) per image."""
    batch = rng.randint(1, 3)
    grids = [rng.choice([(1, 1), (1, 2), (2, 1)]) for _ in range(rng.randint(1, 4) if images else 0)]
    mask_size, base = PHI4_CROP // PHI4_PATCH, PHI4_CROP // PHI4_PATCH // 2
    blocks, crops, masks = [], [], []
    for rows, cols in grids:
        mask = torch.ones(rows * mask_size, cols * mask_size)
        pad_h, pad_w = rng.choice([(0, 0), (0, 2), (2, 0), (1, 0)])  # padded patches of the resized image
        if pad_w:
            mask[:, -pad_w:] = 0
        if pad_h:
            mask[-pad_h:, :] = 0
        sub = mask.reshape(rows, mask_size, cols, mask_size).transpose(1, 2).reshape(-1, mask_size, mask_size)
        down = mask[0::2, 0::2]
        blocks.append([PHI4_IMAGE] * (base * (base + 1) + 1 + int(down.sum()) + int(down[:, 0].sum())))
        crops.append(torch.randn(1 + rows * cols, 3, PHI4_CROP, PHI4_CROP))
        masks.append(torch.cat([torch.ones(1, mask_size, mask_size), sub]))
    call = sequences_with(rng, batch, blocks, owners_of(rng, batch, len(grids)))
    if not grids:
        return call
    most = max(c.shape[0] for c in crops)
    pixel_values = torch.zeros(len(grids), most, 3, PHI4_CROP, PHI4_CROP)
    attention = torch.zeros(len(grids), most, mask_size, mask_size)
    for i, (c, m) in enumerate(zip(crops, masks)):
        pixel_values[i, : c.shape[0]] = c
        attention[i, : m.shape[0]] = m
    sizes = torch.tensor([[rows * PHI4_CROP, cols * PHI4_CROP] for rows, cols in grids])
    return dict(call, image_pixel_values=pixel_values, image_sizes=sizes, image_attention_mask=attention)


PHI4_AUDIO, PHI4_TIME_REDUCTION = 251, 8  # the audio token; the encoder's subsampling (config default)


def phi4_audio_batch(model, rng: random.Random, audio: bool) -> dict:
    """1-3 audio clips of 20-70 feature frames (16 mel bins), padded to the longest (audio_attention_mask
    marks each clip's frames), each clip's <audio> x ceil(frames / 8) (the encoder's output length, the
    processor's audio_embed_sizes) at the end of a random one of the sequences; every other call also
    with 1-4 images (``phi4_batch``: the vision-speech projection then)."""
    call = phi4_batch(model, rng, images=audio and rng.random() < 0.5)
    if not audio:
        return call
    lengths = [rng.randint(20, 70) for _ in range(rng.randint(1, 3))]
    tokens = [-(-n // PHI4_TIME_REDUCTION) for n in lengths]
    sequences = [ids[mask == 1].tolist() for ids, mask in zip(call["input_ids"], call["attention_mask"])]
    for owner, count in zip(owners_of(rng, len(sequences), len(lengths)), tokens):
        sequences[owner] += [PHI4_AUDIO] * count + words(rng, 1, 2)
    ids, mask = padded(sequences)
    features = torch.zeros(len(lengths), max(lengths), 16)
    frames = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for i, n in enumerate(lengths):
        features[i, :n] = torch.randn(n, 16)
        frames[i, :n] = True
    return dict(call, input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                audio_input_features=features, audio_embed_sizes=torch.tensor(tokens), audio_attention_mask=frames)


# --- Emu3 -----------------------------------------------------------------------------------------

EMU3_CODES, EMU3_EOL, EMU3_IMAGE = 32, 249, 250  # visual words 200-231 in the text vocabulary


def build_emu3() -> torch.nn.Module:
    """VQ-VAE image tokenizer (3D conv encoder, 2x spatial downsampling, a 32-code codebook) whose
    codes become text tokens (+ an end-of-line token per row); Llama-style text."""
    import transformers

    vocabulary = {"<image>": EMU3_IMAGE, "<|extra_200|>": EMU3_EOL}
    vocabulary.update({f"<|visual token {k:06d}|>": 200 + k for k in range(EMU3_CODES)})
    config = transformers.Emu3Config(
        vq_config=dict(codebook_size=EMU3_CODES, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[], temporal_downsample_factor=2,
                       hidden_size=64),
        text_config=dict(TEXT, bos_token_id=1, eos_token_id=2, attention_dropout=0.0),
        vocabulary_map=vocabulary)
    return eager(transformers.Emu3ForConditionalGeneration, config)


def emu3_batch(model, rng: random.Random, images: bool) -> dict:
    """1-4 images of random sizes (h, w multiples of 2 in 4-12 px), pixel_values (images, 3, max h, max
    w) zero padded, image_sizes; <image> x (h/2 · (w/2 + 1)) per image (a code per 2x2 px, an EOL per
    row)."""
    batch = rng.randint(1, 3)
    sizes = [(2 * rng.randint(2, 6), 2 * rng.randint(2, 6)) for _ in range(rng.randint(1, 4) if images else 0)]
    blocks = [[EMU3_IMAGE] * ((h // 2) * (w // 2 + 1)) for h, w in sizes]
    call = sequences_with(rng, batch, blocks, owners_of(rng, batch, len(sizes)))
    if not sizes:
        return call
    pixel_values = torch.zeros(len(sizes), 3, max(h for h, _ in sizes), max(w for _, w in sizes))
    for i, (h, w) in enumerate(sizes):
        pixel_values[i, :, :h, :w] = torch.randn(3, h, w)
    return dict(call, pixel_values=pixel_values, image_sizes=torch.tensor(sizes))


# --- the tests ----------------------------------------------------------------------------------


@dataclass
class Family:
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.nn.Module, random.Random, bool], dict]
    measured: tuple[str, ...]  # the modules whose own code is data-dependent: measured on every media call
    media: str = "pixel_values"  # the input a media call has (a text-only call has not)


FAMILIES = {  # the measured modules: where each family's data-dependent line is
    "ovis2": Family(build_ovis2, ovis2_batch, ("model",)),  # if mask.any(): per visual indicator
    "emu3": Family(build_emu3, emu3_batch, ("model.vqmodel",)),  # encode: codes sliced by image_sizes
}
PARAMETERS = list(FAMILIES)


def random_batch(family: str, model, rng: random.Random, images: bool, training: bool) -> dict:
    call = FAMILIES[family].batch(model, rng, images)
    if not training:
        del call["labels"]
    return call


def check_measured(family: str, wrapper, batch: dict, where) -> None:
    expected = FAMILIES[family]
    if expected.media in batch:  # measured exactly where the data-dependent code is
        assert set(wrapper.measured) == set(expected.measured), (*where, wrapper.measured)


def check_programs(family: str, wrapper) -> None:
    for program in wrapper.programs:
        assert not program.unsupported, (family, [str(u) for u in program.unsupported])


@pytest.mark.long
@pytest.mark.parametrize("family", PARAMETERS)
def test_forward_counts_equal_flop_counter_per_module(family):
    """``CALLS`` random forward calls under no_grad through one strict wrapper: each call's total and
    every module FlopCounterMode names equal FlopCounterMode's; image calls are measured."""
    pytest.importorskip("transformers")
    model = FAMILIES[family].build()
    wrapper = fxflops.instrument(model, strict=True)
    rng = random.Random(f"{family}-forward")
    for i in range(CALLS):
        batch = random_batch(family, model, rng, images=i not in TEXT_ONLY, training=False)
        expected = flop_counter_modules(model, batch, backward=False)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(**batch)
        got = wrapper.flops.breakdown()
        where = (family, i, FAMILIES[family].media in batch, tuple(batch["input_ids"].shape))
        assert wrapper.flops.uncounted == 0, where
        assert wrapper.flops.total() == got[""] == expected[""] > 0, where
        for path, flops in expected.items():
            assert got.get(path) == flops, (*where, path)
        check_measured(family, wrapper, batch, where)
    check_programs(family, wrapper)


@pytest.mark.long
@pytest.mark.parametrize("family", PARAMETERS)
def test_training_counts_equal_flop_counter(family):
    """``CALLS`` random training calls (forward + ``loss.backward()``) through one strict wrapper with
    ``backward=True``: each call's total equals FlopCounterMode's forward + backward, its forward
    phase FlopCounterMode's forward; image calls are measured."""
    pytest.importorskip("transformers")
    model = FAMILIES[family].build()
    reference = degrouped(model)
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    rng = random.Random(f"{family}-training")
    for i in range(CALLS):
        batch = random_batch(family, model, rng, images=i not in TEXT_ONLY, training=True)
        forward = flop_counter_modules(reference, batch, backward=False)[""]
        training = flop_counter_modules(reference, batch, backward=True)[""]
        wrapper.train()
        wrapper.flops.reset()
        model.zero_grad(set_to_none=True)
        wrapper(**batch).loss.backward()
        where = (family, i, FAMILIES[family].media in batch, tuple(batch["input_ids"].shape))
        assert wrapper.flops.uncounted == 0, where
        assert wrapper.flops.total() == training, where
        assert wrapper.flops.total(phase="fwd") == forward, where
        assert training > forward > 0, where
        check_measured(family, wrapper, batch, where)
    check_programs(family, wrapper)
