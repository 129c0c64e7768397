"""The example VLM: per-module forward FLOPs from ONE trace, packed text and per-frame vision attention.

Reference: FlopCounterMode on the same batch through the same weights with ``attention="loop"``, where
every packed segment's attention is an explicit pair of matmuls that FlopCounterMode counts (it cannot
see inside the varlen custom op, and its own varlen formula syncs on ``cum_seq.tolist()``).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import sympy
import torch

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch
from reference import count_and_compare, reference_counts

CFG = VLMConfig()
DIMS = {"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}}
SEGMENTS = {"cu_seqlens": "text", "image_grid_thw": "frames"}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = TinyVLM(CFG)
    reference = TinyVLM(replace(CFG, attention="loop"))
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("draws", [20, pytest.param(50, marks=pytest.mark.long)])
def test_random_microbatches_equal_flopcountermode_per_module(models, draws):
    model, reference = models
    wrapper = fxflops.instrument(model, dims=DIMS, segments=SEGMENTS, on_miss="raise", strict=True)
    rng = random.Random(1)
    images_seen = set()
    for draw in range(draws):
        batch = random_batch(CFG, rng, images=(1, 8), frames=(1, 3), sequences=(1, 32), padding=rng.choice([0, 0, 3, 17]))
        images_seen.add(len(batch.image_grid_thw))
        count_and_compare(wrapper, reference, batch.inputs(), draw)
    assert wrapper.captures == 1, "one capture serves every image count, resolution and packing"
    assert len(images_seen) >= 6


def test_formula_has_power_sums_and_no_pinned_image_count(models):
    model, _ = models
    program = fxflops.trace(model, random_batch(CFG, random.Random(2)).inputs(), dims=DIMS, segments=SEGMENTS)
    names = {str(s) for s in program.formula().free_symbols}
    assert names == {"tokens", "patches", "text_p2", "frames_p2"}
    meaning = program.describe_symbols()
    assert "cu_seqlens" in meaning["text_p2"] and "image_grid_thw" in meaning["frames_p2"]
    # vision attention: 4·heads·head_dim per layer times Σ frame², bidirectional (written from the math)
    hv, layers = CFG.vision_hidden, CFG.vision_layers
    assert program.formula("visual").coeff(sympy.Symbol("frames_p2", integer=True, nonnegative=True)) == 4 * hv * layers


def core_attention(breakdown: dict[str, int], prefix: str) -> int:
    """FLOPs done by attention modules themselves (their op), without their projection children."""
    total = 0
    for path, flops in breakdown.items():
        if path.startswith(prefix) and path.endswith(("self_attn", "attn")):
            children = [p for p in breakdown if p.startswith(path + ".") and p.count(".") == path.count(".") + 1]
            total += flops - sum(breakdown[c] for c in children)
    return total


def count(wrapper, batch) -> dict[str, int]:
    wrapper.flops.reset()
    with torch.no_grad():
        wrapper(*batch.inputs())
    return wrapper.flops.breakdown()


def text_batch(lengths: list[int], padding: int = 0):
    """Only text: sequences of the given lengths packed in one row, then ``padding`` tokens."""
    rng = random.Random(3)
    ids = [rng.randrange(CFG.image_token_id) for _ in range(sum(lengths) + padding)]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    grid = torch.tensor([[1, 2, 2]])  # one tiny image, its single merged token at the front
    ids[0] = CFG.image_token_id
    return _Batch(torch.tensor([ids]), torch.tensor(offsets, dtype=torch.int32), torch.randn(4, CFG.pixel_dim), grid)


class _Batch:
    def __init__(self, *tensors):
        self.tensors = tensors

    def inputs(self):
        return self.tensors


def test_packed_equal_sequences_cost_pack_count_times_less_attention(models):
    """32 packed sequences of 64 tokens: core attention is 32× less than one 2048-token sequence
    (the pack-length² approximation), and FlopCounterMode on the loop reference agrees."""
    model, reference = models
    wrapper = fxflops.instrument(model, dims=DIMS, segments=SEGMENTS)
    packed, whole = text_batch([64] * 32), text_batch([2048])
    core_packed = core_attention(count(wrapper, packed), "language_model")
    core_whole = core_attention(count(wrapper, whole), "language_model")
    assert core_whole == 32 * core_packed
    assert core_packed == core_attention(reference_counts(reference, *packed.inputs()), "language_model")
    assert wrapper.captures == 1


def test_padding_changes_linear_layers_only_by_the_padding_share(models):
    """The same sequences packed to 2048 or 4096 tokens (rest padding, not attended): identical
    attention FLOPs; everything else differs by exactly 2048 tokens × 2·(text matmul weights)."""
    model, _ = models
    wrapper = fxflops.instrument(model, dims=DIMS, segments=SEGMENTS)
    lengths = [300, 700, 511, 400]
    short, long = text_batch(lengths, 2048 - sum(lengths)), text_batch(lengths, 4096 - sum(lengths))
    at_2048, at_4096 = count(wrapper, short), count(wrapper, long)
    assert core_attention(at_2048, "language_model") == core_attention(at_4096, "language_model")
    c = CFG
    head_dim = c.hidden // c.heads
    per_layer = c.hidden * head_dim * (2 * c.heads + 2 * c.kv_heads) + 3 * c.hidden * c.ffn
    text_matmul_weights = c.layers * per_layer + c.hidden * c.vocab
    assert at_4096[""] - at_2048[""] == 2048 * 2 * text_matmul_weights
    assert at_4096["visual"] == at_2048["visual"]


def test_vision_cost_follows_per_frame_squares_not_total_patches(models):
    """64 patches as one 8×8 image, four 4×4 images, or a 4-frame 4×4 video: same linear work, but
    attention follows Σ(h·w)² per frame — the video costs exactly what four images cost."""
    model, reference = models
    wrapper = fxflops.instrument(model, dims=DIMS, segments=SEGMENTS)

    def vision_batch(grid):
        patches = sum(t * h * w for t, h, w in grid)
        ids = torch.full((1, patches // 4 + 5), 7)
        ids[0, : patches // 4] = CFG.image_token_id
        cu = torch.tensor([0, patches // 4 + 5], dtype=torch.int32)
        return _Batch(ids, cu, torch.randn(patches, CFG.pixel_dim), torch.tensor(grid))

    one, four, video = vision_batch([[1, 8, 8]]), vision_batch([[1, 4, 4]] * 4), vision_batch([[4, 4, 4]])
    big, small, clip = (count(wrapper, b) for b in (one, four, video))
    assert small["visual"] == clip["visual"]
    per_square = 4 * CFG.vision_hidden * CFG.vision_layers
    assert big["visual"] - small["visual"] == per_square * (64**2 - 4 * 16**2)
    for batch, got in ((one, big), (video, clip)):
        assert got["visual"] == reference_counts(reference, *batch.inputs())["visual"]
    assert wrapper.captures == 1


def test_block_diagonal_mask_on_dense_sdpa_is_counted_dense_and_reported():
    """A boolean block-diagonal mask makes dense SDPA compute only within sequences numerically, but
    the kernel still does the full (Σs)² work: counted as such (FlopCounterMode's MATH reference
    agrees), and the program says so in its notes and table."""

    class MaskedPacked(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    lengths = [3, 5, 4]
    total = sum(lengths)
    mask = torch.block_diag(*(torch.ones(n, n, dtype=torch.bool) for n in lengths))
    q = torch.randn(1, 2, total, 8)
    program = fxflops.trace(MaskedPacked(), (q, q, q, mask), dims={"q": {2: "t"}, "k": {2: "t"}, "v": {2: "t"}, "mask": {0: "t", 1: "t"}})
    assert program.total(t=total) == reference_counts(MaskedPacked(), q, q, q, mask)[""] == 4 * 2 * total * total * 8
    assert any("has a mask (attn_mask)" in note for note in program.notes)
    assert "note:" in program.table(t=total)
