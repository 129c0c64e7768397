"""Per-segment lifting: modules that loop over packed segments in Python, traced on one segment.

The subject is the example VLM with ``attention="loop"``: attention split by ``lengths.tolist()`` as
Hugging Face's vision attention does. Reference: FlopCounterMode on that same model and batch.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import sympy
import torch
from torch import nn

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch
from reference import count_and_compare, per_module_training_reference

CFG = replace(VLMConfig(), attention="loop")
DIMS = {"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}}
PER_SEGMENT = {"visual.blocks.*.attn": "cu_seqlens", "language_model.layers.*.self_attn": "cu_seqlens"}
SEGMENTS = {"cu_seqlens": "text", "image_grid_thw": "frames"}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyVLM(CFG)


def test_looping_attention_does_not_trace_without_lifting(model):
    with pytest.raises(fxflops.CaptureError, match=r"tiny_vlm.py:\d+ in packed_attention.*per_segment="):
        fxflops.trace(model, random_batch(CFG, random.Random(0)).inputs(), dims=DIMS)


def test_lifted_modules_equal_flopcountermode_on_random_batches(model):
    wrapper = fxflops.instrument(
        model, dims=DIMS, segments=SEGMENTS, per_segment=PER_SEGMENT, on_miss="raise", strict=True
    )
    rng = random.Random(4)
    for draw in range(30):
        batch = random_batch(CFG, rng, images=(1, 6), sequences=(1, 20))
        count_and_compare(wrapper, model, batch.inputs(), draw)
    assert wrapper.captures == 1


def test_lifted_formula_is_the_varlen_formula(model):
    """P(s) per segment summed over segments: with exact cover, p1 = the packed length, and the
    formula equals the one traced through the varlen op in one piece."""
    batch = random_batch(CFG, random.Random(5))
    lifted = fxflops.trace(model, batch.inputs(), dims=DIMS, segments=SEGMENTS, per_segment=PER_SEGMENT)
    varlen_model = TinyVLM(replace(CFG, attention="varlen"))
    whole = fxflops.trace(varlen_model, batch.inputs(), dims=DIMS, segments=SEGMENTS)
    names = {str(s): s for s in lifted.symbols}
    covered = lifted.formula().subs({names["text_p1"]: names["tokens"], names["frames_p1"]: names["patches"]})
    assert sympy.expand(covered - whole.formula()) == 0
    assert {"text_p1", "frames_p1", "text_p2", "frames_p2"} <= set(names)


def test_lifted_modules_need_offsets_that_cover_every_row(model):
    """A per-segment module processes every packed row but is billed per segment: padding past
    the last offset would go unbilled, so it is refused, naming the input."""
    program = fxflops.trace(model, random_batch(CFG, random.Random(6)).inputs(), dims=DIMS, per_segment=PER_SEGMENT)
    padded = random_batch(CFG, random.Random(7), padding=5)
    with pytest.raises(fxflops.MetadataError, match="'cu_seqlens'.*cover"):
        program.count(*padded.inputs())


class _Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, cu_seqlens):
        return self.inner(x, cu_seqlens)


class _LongOnly(nn.Module):
    """Applies its layer only to segments longer than 3 (a bound on the segment length)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, cu_seqlens):
        chunks = torch.split(x, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
        return torch.cat([self.fc(c) if c.shape[0] > 3 else c for c in chunks])


class _EvenOnly(_LongOnly):
    def forward(self, x, cu_seqlens):
        chunks = torch.split(x, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
        return torch.cat([self.fc(c) if c.shape[0] % 2 == 0 else c for c in chunks])


def test_lifting_checks_bounds_on_the_segment_length_per_batch():
    """The one-segment trace took the branch for s > 3: the program is exact for batches whose
    segments all satisfy that, and a batch with a shorter segment is refused, naming the bound."""
    x, cu = torch.randn(10, 4), torch.tensor([0, 4, 10])
    program = fxflops.trace(_Outer(_LongOnly()), (x, cu), per_segment={"inner": "cu_seqlens"})
    assert program.count(torch.randn(13, 4), torch.tensor([0, 5, 13])) == 2 * 13 * 4 * 4
    with pytest.raises(fxflops.MetadataError, match=r"segments of length \[2\].*s > 3"):
        program.count(torch.randn(7, 4), torch.tensor([0, 2, 7]))


def test_lifting_checks_any_condition_on_the_segment_length():
    """A parity condition (``s % 2 == 0``) is checked per segment too."""
    x, cu = torch.randn(10, 4), torch.tensor([0, 4, 10])
    program = fxflops.trace(_Outer(_EvenOnly()), (x, cu), per_segment={"inner": "cu_seqlens"})
    assert program.count(torch.randn(12, 4), torch.tensor([0, 8, 12])) == 2 * 12 * 4 * 4
    with pytest.raises(fxflops.MetadataError, match=r"segments of length \[3\]"):
        program.count(torch.randn(7, 4), torch.tensor([0, 4, 7]))


def test_unmatched_pattern_is_an_error(model):
    with pytest.raises(fxflops.CaptureError, match="match no module"):
        fxflops.trace(model, random_batch(CFG, random.Random(8)).inputs(), per_segment={"vision.*": "cu_seqlens"})


def test_capture_leaves_no_stand_in_behind(model):
    fxflops.trace(model, random_batch(CFG, random.Random(9)).inputs(), dims=DIMS, per_segment=PER_SEGMENT)
    assert all("forward" not in vars(m) for m in model.modules())


def test_lifting_maps_sizes_and_tables_read_from_the_offsets():
    """Like Hugging Face's vision attention: a per-row table whose size the outer trace could only read
    from the offsets' data, and a ``max_seqlen`` read from them, both passed to the looping module.
    In the one-segment trace they become the segment's length s. Reference: per-segment matmul
    FLOPs summed by hand."""

    class Looping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8, bias=False)

        def forward(self, x, cu_seqlens, table, max_seqlen):
            chunks = torch.split(x * table, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
            return torch.cat([self.fc(c) for c in chunks])

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Looping()

        def forward(self, x, cu_seqlens):
            rows = cu_seqlens[-1].item()  # a size from data, as HF's per-image rotary tables
            table = torch.ones(rows, x.shape[1])
            max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
            return self.inner(x, cu_seqlens, table, max_seqlen)

    x, cu = torch.randn(10, 8), torch.tensor([0, 4, 10])
    program = fxflops.trace(Outer(), (x, cu), dims={"x": {0: "rows"}}, per_segment={"inner": "cu_seqlens"})
    for lengths in ([10], [3, 3, 4], [1, 9]):
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        assert program.count(torch.randn(sum(lengths), 8), offsets) == sum(2 * s * 8 * 8 for s in lengths)


def test_lifted_modules_count_their_backward_exactly():
    """backward=True with per_segment: each looping module's one-segment trace is joint, its backward
    billed per segment; forward + backward per module equals every module replayed alone under
    FlopCounterMode (the reference counts the loop's explicit matmuls and their gradients)."""
    cfg = replace(VLMConfig(vision_layers=1, layers=1), attention="loop")
    torch.manual_seed(0)
    model = TinyVLM(cfg)
    wrapper = fxflops.instrument(model, dims=DIMS, per_segment=PER_SEGMENT, backward=True, strict=True)
    rng = random.Random(12)
    for draw in range(8):
        batch = random_batch(cfg, rng, images=(1, 5), sequences=(1, 10))
        wrapper.flops.reset()
        wrapper(*batch.inputs()).sum().backward()
        got = wrapper.flops.breakdown()
        for path, flops in per_module_training_reference(model, *batch.inputs()).items():
            assert got[path] == flops, (draw, path)
        assert wrapper.flops.total(phase="bwd") > wrapper.flops.total(phase="fwd")
    assert wrapper.captures == 1
