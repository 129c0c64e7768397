"""Segment metadata: binding without syncs, validation, the varlen op and the varlen rules."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch
from fxflops.ops import varlen_attention

CFG = VLMConfig(vision_layers=1, layers=1)
DIMS = {"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}}


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    model = TinyVLM(CFG)
    return fxflops.trace(model, random_batch(CFG, random.Random(0)).inputs(), dims=DIMS)


def brute_force_power_sums(batch):
    """p2 of the text sequences and of the frames, from plain Python lists."""
    text = [b - a for a, b in zip(batch.cu_seqlens.tolist(), batch.cu_seqlens.tolist()[1:])]
    frames = [h * w for t, h, w in batch.image_grid_thw.tolist() for _ in range(t)]
    return sum(s * s for s in text), sum(s * s for s in frames)


def test_power_sums_from_host_metadata(program):
    batch = random_batch(CFG, random.Random(5))
    values = dict(zip(map(str, program.all_symbols), program.binder.values(batch.inputs(), {})))
    assert (values["cu_seqlens_p2"], values["image_grid_thw_p2"]) == brute_force_power_sums(batch)


def test_device_path_gives_the_same_power_sums(program):
    """The accelerator path (tensor ops on the metadata's device, 0-d tensor results) run on CPU."""
    batch = random_batch(CFG, random.Random(6))
    program.binder.host_metadata = False
    try:
        values = dict(zip(map(str, program.all_symbols), program.binder.values(batch.inputs(), {})))
    finally:
        program.binder.host_metadata = True
    assert isinstance(values["cu_seqlens_p2"], torch.Tensor) and values["cu_seqlens_p2"].dim() == 0
    text, frames = brute_force_power_sums(batch)
    assert (int(values["cu_seqlens_p2"]), int(values["image_grid_thw_p2"])) == (text, frames)


def _malformed_variants(batch):
    """(what is wrong, inputs) for metadata the host checks would refuse."""
    inputs = list(batch.inputs())
    cu, grid = batch.cu_seqlens, batch.image_grid_thw

    def replaced(index, tensor):
        changed = list(inputs)
        changed[index] = tensor
        return tuple(changed)

    decreasing = cu.clone()
    decreasing[1], decreasing[2] = int(cu[2]), int(cu[1])
    shifted = cu + 1
    overlong = cu.clone()
    overlong[-1] += 5
    too_many_patches = grid.clone()
    too_many_patches[0, 0] += 3
    return [
        ("cu_seqlens", replaced(1, decreasing)),
        ("cu_seqlens", replaced(1, shifted)),
        ("cu_seqlens", replaced(1, overlong)),
        ("image_grid_thw", replaced(3, too_many_patches)),
    ]


def test_device_metadata_is_validated_on_the_device_and_reported():
    """On an accelerator the binder cannot read metadata without a sync; it checks it with tensor ops
    instead: a malformed call adds nothing, and the report names the input and how many calls."""
    torch.manual_seed(0)
    model = TinyVLM(CFG)
    wrapper = fxflops.instrument(model, dims=DIMS)
    rng = random.Random(11)
    good = [random_batch(CFG, rng) for _ in range(3)]
    with torch.no_grad():
        wrapper(*good[0].inputs())
        program = wrapper.program
        expected = sum(program.count(*b.inputs()) for b in good)  # the host path: validated, exact
        program.binder.host_metadata = False  # the accelerator path, on CPU tensors
        try:
            wrapper.flops.reset()
            for batch in good:
                wrapper(*batch.inputs())
            malformed = [variant for batch in good for variant in _malformed_variants(batch)]
            for _, inputs in malformed:
                wrapper(*inputs)
            assert wrapper.flops.total() == expected  # the malformed calls added nothing
            with pytest.warns(UserWarning, match="malformed segment metadata on a device.*'cu_seqlens'"):
                report = wrapper.flops.report(elapsed_s=1.0)
            by_input = {"cu_seqlens": 9, "image_grid_thw": 3}
            assert report.malformed == by_input and report.uncounted == 12 and report.calls == 3
            assert "call(s) with 'image_grid_thw'" in str(report)
            for name, inputs in malformed[:4]:
                with pytest.raises(fxflops.MetadataError, match=name):
                    program.count(*inputs)
        finally:
            program.binder.host_metadata = True


def test_binding_reads_no_metadata_values_on_meta_or_fake_tensors(program):
    """Binding works on meta-device and fake metadata: it never reads values to the host (which
    would be a host-device sync on an accelerator)."""
    batch = random_batch(CFG, random.Random(7))
    on_meta = [t.to("meta") if t.dtype != torch.float32 else t for t in batch.inputs()]
    values = program.binder.values(tuple(on_meta), {})
    stats = [v for s, v in zip(program.all_symbols, values) if str(s).endswith("_p2")]
    assert stats and all(v.device.type == "meta" for v in stats)
    monomials = program.monomials(*values)
    assert any(isinstance(m, torch.Tensor) and m.device.type == "meta" for m in monomials)

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t.to("meta")) if t.dtype != torch.float32 else t for t in batch.inputs()]
        values = program.binder.values(tuple(fake), {})
    assert len(values) == len(program.all_symbols)


def test_meter_accumulates_device_values_until_read(program):
    """Monomials with device entries accumulate as tensors; the read converts once, exactly."""
    meter = fxflops.Meter()
    batches = [random_batch(CFG, random.Random(s)) for s in (8, 9, 10)]
    program.binder.host_metadata = False
    try:
        for batch in batches:
            meter.add(program, program.monomials(*program.binder.values(batch.inputs(), {})))
    finally:
        program.binder.host_metadata = True
    assert any(isinstance(a, torch.Tensor) for _, acc, *_ in meter._sums.values() for a in acc)
    assert meter.total() == sum(program.count(*b.inputs()) for b in batches)


def test_malformed_metadata_names_the_input(program):
    batch = random_batch(CFG, random.Random(11), sequences=(3, 5))
    ids, cu, pixels, grid = batch.inputs()
    decreasing = cu.clone()
    decreasing[2], decreasing[1] = decreasing[1], decreasing[2] + 1
    with pytest.raises(fxflops.MetadataError, match="'cu_seqlens' decrease at index"):
        program.count(ids, decreasing, pixels, grid)
    overrun = cu.clone()
    overrun[-1] = ids.shape[1] + 1
    with pytest.raises(fxflops.MetadataError, match="'cu_seqlens' end at .* past the packed length"):
        program.count(ids, overrun, pixels, grid)
    shifted = cu.clone() + 1
    with pytest.raises(fxflops.MetadataError, match="must start at 0"):
        program.count(ids, shifted, pixels, grid)
    too_big = grid.clone()
    too_big[0, 1] += 2
    with pytest.raises(fxflops.MetadataError, match="'image_grid_thw' describes segments totalling"):
        program.count(ids, cu, pixels, too_big)


def test_malformed_metadata_warns_in_training_unless_strict():
    torch.manual_seed(0)
    model = TinyVLM(CFG)
    batch = random_batch(CFG, random.Random(12), sequences=(3, 5))
    lenient = fxflops.instrument(model, dims=DIMS)
    lenient(*batch.inputs())
    ids, cu, pixels, grid = batch.inputs()
    bad = cu.clone()
    bad[-1] = ids.shape[1] + 9
    with pytest.warns(UserWarning, match="past the packed length"):
        lenient(ids, bad, pixels, grid)
    assert lenient.flops.uncounted == 1 and lenient.captures == 1
    strict = fxflops.instrument(model, dims=DIMS, strict=True)
    strict(*batch.inputs())
    with pytest.raises(fxflops.MetadataError):
        strict(ids, bad, pixels, grid)


def test_varlen_op_matches_per_segment_attention_and_has_autograd():
    torch.manual_seed(0)
    q = torch.randn(10, 4, 8, requires_grad=True)
    k = torch.randn(10, 2, 8, requires_grad=True)
    v = torch.randn(10, 2, 8, requires_grad=True)
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)  # an empty segment, and one padding row
    out = varlen_attention(q, k, v, cu, cu, True)
    for a, b in ((0, 3), (3, 9)):
        qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].repeat_interleave(2, 1).transpose(0, 1), v[a:b].repeat_interleave(2, 1).transpose(0, 1)
        expected = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[a:b], expected)
    assert out[9].abs().sum() == 0
    torch.library.opcheck(torch.ops.fxflops.varlen_attention.default, (q, k, v, cu, cu, True))
    out.sum().backward()
    assert q.grad is not None and k.grad.shape == k.shape and v.grad[9].abs().sum() == 0


class VarlenBlock(nn.Module):
    """One attention over packed rows through a chosen varlen API."""

    def __init__(self, api: str) -> None:
        super().__init__()
        self.api = api
        self.qkv = nn.Linear(32, 96, bias=False)

    def forward(self, x, cu_seqlens):
        q, k, v = self.qkv(x).view(-1, 3, 4, 8).unbind(1)
        if self.api == "fxflops":
            return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, False)
        if self.api == "aten_flash":
            return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, 8, 8, 0.0, False, False)[0]
        if self.api == "torch_varlen":
            from torch.nn.attention.varlen import varlen_attn

            return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, 8, 8)
        raise AssertionError(self.api)


@pytest.mark.parametrize("api", ["fxflops", "aten_flash", "torch_varlen"])
def test_varlen_apis_count_sum_of_squares(api):
    """Traced (fake tensors: the CUDA-only kernels never run) with a packed cu_seqlens input; the
    attention term is 4·heads·head_dim·Σsᵢ², written from the math, for any packing."""
    model = VarlenBlock(api)
    x, cu = torch.randn(20, 32), torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    program = fxflops.trace(model, (x, cu), dims={"x": {0: "rows"}})
    for lengths in ([20], [1, 2, 3, 14], [7, 7, 6]):
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        rows = sum(lengths)
        expected = 2 * rows * 32 * 96 + 4 * 4 * 8 * sum(s * s for s in lengths)
        assert program.count(torch.randn(rows, 32), offsets) == expected


@torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())
def _fake_flash_attn_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for flash-attn's op (not installable without CUDA): same name and signature."""
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0])


@_fake_flash_attn_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0])


def test_flash_attn_package_op_is_counted_by_name():
    class UsesFlashAttn(nn.Module):
        def forward(self, q, k, v, cu):
            return torch.ops.flash_attn._flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8, 0.0, 1.0, True)[0]

    q, cu = torch.randn(12, 4, 16), torch.tensor([0, 4, 12], dtype=torch.int32)
    program = fxflops.trace(UsesFlashAttn(), (q, q, q, cu), dims={"q": {0: "n"}, "k": {0: "n"}, "v": {0: "n"}})
    assert program.count(q, q, q, cu) == 4 * 4 * 16 * (4 * 4 + 8 * 8)


def test_offsets_fxflops_cannot_follow_give_a_clear_error():
    class Opaque(nn.Module):
        def forward(self, x, lengths):
            cu = torch.nn.functional.pad(lengths.sort().values.cumsum(0), (1, 0))
            return varlen_attention(x, x, x, cu, cu, False)

    x = torch.randn(9, 2, 4)
    with pytest.raises(fxflops.CaptureError, match="cannot tell the segment lengths"):
        fxflops.trace(Opaque(), (x, torch.tensor([4, 5])))


def test_flopcountermode_cannot_see_the_varlen_op():
    """Why the tests use a loop reference: the custom op is opaque to FlopCounterMode (0 FLOPs)."""
    q = torch.randn(6, 2, 4)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with FlopCounterMode(display=False) as counter:
        varlen_attention(q, q, q, cu, cu, False)
    assert counter.get_total_flops() == 0


def test_offsets_through_no_op_reshapes_are_followed():
    """Hugging Face's Qwen2-VL builds the repeat counts as grid[:, 0].view(-1).expand(n): reshapes of
    a vector to itself keep the rows, so the family is still per-frame h·w from image_grid_thw."""

    class Reshaped(nn.Module):
        def forward(self, x, grid):
            counts = grid[:, 0].reshape(-1).expand(grid.shape[0])
            cu = torch.nn.functional.pad(torch.repeat_interleave(grid[:, 1] * grid[:, 2], counts).cumsum(0), (1, 0))
            return varlen_attention(x, x, x, cu, cu, False)

    grid = torch.tensor([[1, 2, 3], [2, 2, 2]])
    x = torch.randn(14, 2, 4)
    program = fxflops.trace(Reshaped(), (x, grid), dims={"x": {0: "rows"}})
    other = torch.tensor([[3, 1, 2], [1, 4, 1], [2, 1, 1]])
    frames = [h * w for t, h, w in other.tolist() for _ in range(t)]
    assert program.count(torch.randn(sum(frames), 2, 4), other) == 4 * 2 * 4 * sum(f * f for f in frames)


def test_power_sums_are_structured_metadata_whose_values_are_the_brute_force_sums():
    """``program.power_sums`` names each power-sum symbol's family and power; on random batches each
    value is Σ sᵢᵏ of that family's segments, summed by hand: the packed sequences from
    ``cu_seqlens``, the frames (t frames of h·w patches) from ``image_grid_thw``."""
    from fxflops.models import tiny_vlm

    example = tiny_vlm.example()
    program = fxflops.trace(example["model"], tuple(example["args"]), dims=example["dims"], segments=example["segments"])
    assert {family for family, _ in program.power_sums.values()} == {"text", "frames"}
    rng = random.Random(5)
    for _ in range(5):
        batch = random_batch(VLMConfig(vision_layers=2, layers=2), rng)
        offsets = batch.cu_seqlens.tolist()
        lengths = {
            "text": [b - a for a, b in zip(offsets, offsets[1:])],
            "frames": [h * w for t, h, w in batch.image_grid_thw.tolist() for _ in range(t)],
        }
        values = dict(zip(map(str, program.all_symbols), program.values(*batch.inputs())))
        for name, (family, k) in program.power_sums.items():
            assert values[name] == sum(s**k for s in lengths[family]), (name, family, k)
