"""Tests for the built-in FLOPs rules (fxflops.rules.matmul / conv / attention).

Every rule is checked against a count made another way:

- ``FlopCounterMode`` (torch.utils.flop_counter) running the real op, where FlopCounterMode is right;
- where FlopCounterMode is wrong or counts 0, an independent reference: the same result computed with
  explicit mm/bmm calls (which FlopCounterMode counts correctly), checked numerically against the op;
- ops that cannot run on this CPU: meta tensors under FlopCounterMode, or FlopCounterMode's own
  formula functions applied to the right shapes.

Rules are applied as the registry promises: ``rule(*shape_of(args), out_shape=shape_of(result), **kwargs)``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from fxflops.analysis.segments import ELEMENT, Family, Lengths, Rows, SegmentLengths
from fxflops.rules import registered_ops, rule_for, segment_args, shape_of

aten = torch.ops.aten
RULE_MODULES = {"fxflops.rules.matmul", "fxflops.rules.conv", "fxflops.rules.attention"}


class Call(NamedTuple):
    """One op call: the op, its real arguments and its real result."""

    op: Any
    args: tuple
    kwargs: dict
    result: Any


def run(op, *args, **kwargs) -> Call:
    """Run ``op`` and keep the call."""
    return Call(op, args, kwargs, op(*args, **kwargs))


def rule_flops(call: Call):
    """The registered rule applied to the call's shapes, as the registry documents."""
    return rule_for(call.op)(*shape_of(call.args), out_shape=shape_of(call.result), **shape_of(call.kwargs))


def counted_flops(fn, *args, **kwargs):
    """(FlopCounterMode's total for ``fn(*args, **kwargs)``, its result)."""
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return counter.get_total_flops(), result


class RecordRuleCalls(TorchDispatchMode):
    """Records every dispatched call whose op has a rule."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if rule_for(func) is not None:
            self.calls.append(Call(func, args, kwargs, result))
        return result


def recorded_calls(fn, *args) -> list[Call]:
    """The calls with a rule that ``fn(*args)`` dispatches."""
    with RecordRuleCalls() as recorder:
        fn(*args)
    return recorder.calls


def randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype, device="meta")


# --------------------------------------------------------------------------------------------------
# matmul
# --------------------------------------------------------------------------------------------------


def _fp8_pair(m, k, n):
    """fp8 (m,k) row-major and (k,n) column-major operands, as _scaled_mm requires."""
    a = randn(m, k, dtype=torch.float32).to(torch.float8_e4m3fn)
    b = randn(n, k, dtype=torch.float32).to(torch.float8_e4m3fn).t()
    return a, b


def _int8(*shape):
    return torch.randint(-8, 8, shape, dtype=torch.int8)


def counted_by_flop_counter_matmul_calls() -> list[Call]:
    """Calls for which FlopCounterMode has a correct formula."""
    scaled_a, scaled_b = _fp8_pair(16, 32, 48)
    one = torch.tensor(1.0)
    return [
        run(aten.mm.default, randn(3, 5), randn(5, 7)),
        run(aten.mm.default, randn(1, 4), randn(4, 9)),
        run(aten.addmm.default, randn(7), randn(3, 5), randn(5, 7), beta=0.5, alpha=2.0),
        run(aten.addmm.default, randn(8, 2), randn(8, 6), randn(6, 2)),
        run(aten.bmm.default, randn(2, 3, 5), randn(2, 5, 4)),
        run(aten.baddbmm.default, randn(3, 1, 4), randn(3, 6, 2), randn(3, 2, 4), beta=0.0),
        run(aten._scaled_mm.default, scaled_a, scaled_b, one, one, out_dtype=torch.float32),
    ]


def mm_of(a, b):
    return torch.mm(a, b)


def grouped_mm_reference(a, b, offs):
    """_grouped_mm as explicit per-group mm calls (the CPU fallback's own loop)."""
    ends = [] if offs is None else offs.tolist()
    starts = [0] + ends[:-1]
    if a.dim() == 3 and b.dim() == 3:
        return torch.stack([torch.mm(a[g], b[g]) for g in range(a.shape[0])])
    if a.dim() == 2 and b.dim() == 3:
        return torch.cat([torch.mm(a[s:e], b[g]) for g, (s, e) in enumerate(zip(starts, ends))])
    if a.dim() == 3:
        return torch.cat([torch.mm(a[g], b[:, s:e]) for g, (s, e) in enumerate(zip(starts, ends))], dim=1)
    return torch.stack([torch.mm(a[:, s:e], b[s:e]) for s, e in zip(starts, ends)])


def _offs(*ends):
    return torch.tensor(ends, dtype=torch.int32)


def grouped_mm_operands():
    """(mat_a, mat_b, offs) for the four rank combinations (sizes keep 16-byte-aligned strides)."""
    return [
        (randn(3, 4, 8, dtype=torch.float32), randn(3, 8, 12, dtype=torch.float32), None),
        (randn(20, 8, dtype=torch.float32), randn(3, 8, 4, dtype=torch.float32), _offs(4, 12, 20)),
        (randn(3, 4, 8, dtype=torch.float32), randn(8, 20, dtype=torch.float32), _offs(8, 12, 20)),
        (randn(4, 24, dtype=torch.float32), randn(24, 8, dtype=torch.float32), _offs(8, 12, 24)),
    ]


def referenced_matmul_calls() -> list[tuple[Call, Any, tuple]]:
    """(call, reference function, reference arguments): ops FlopCounterMode counts 0 or does not know.

    Each reference recomputes the op's result with mm/bmm/addmm, which FlopCounterMode counts right.
    """
    cases = []

    def add(op, args, reference, reference_args, **kwargs):
        cases.append((run(op, *args, **kwargs), reference, reference_args))

    for m, n in [(3, 5), (1, 7), (6, 1)]:
        mat, vec, bias = randn(m, n), randn(n), randn(m)
        add(aten.mv.default, (mat, vec), mm_of, (mat, vec[:, None]))
        add(aten.addmv.default, (bias, mat, vec), lambda *t: torch.addmm(*t, beta=2.0),
            (bias[:, None], mat, vec[:, None]), beta=2.0)
        vec1, vec2 = randn(m), randn(n)
        self_ = randn(m, n)
        add(aten.addr.default, (self_, vec1, vec2), torch.addmm, (self_, vec1[:, None], vec2[None, :]))
    for size in [1, 6]:
        x, y = randn(size), randn(size)
        add(aten.dot.default, (x, y), mm_of, (x[None, :], y[:, None]))
        zx, zy = randn(size, dtype=torch.complex128), randn(size, dtype=torch.complex128)
        add(aten.vdot.default, (zx, zy), mm_of, (zx.conj()[None, :], zy[:, None]))
    for b, m, k, n in [(3, 2, 4, 5), (1, 3, 3, 1)]:
        batch1, batch2, self_ = randn(b, m, k), randn(b, k, n), randn(m, n)
        flat1 = batch1.permute(1, 0, 2).reshape(m, b * k)
        add(aten.addbmm.default, (self_, batch1, batch2), torch.addmm, (self_, flat1, batch2.reshape(b * k, n)))
    for m, k, n in [(32, 16, 24), (17, 8, 5)]:
        a, b = _int8(m, k), _int8(k, n)
        add(aten._int_mm.default, (a, b), mm_of, (a.double(), b.double()))
    x, weight, scales = randn(3, 32, dtype=torch.float32), _int8(16, 32), randn(16, dtype=torch.float32)
    add(aten._weight_int8pack_mm.default, (x, weight, scales), lambda a, w, s: torch.mm(a, w.t()) * s,
        (x, weight.float(), scales))
    bias, mat1, mat2 = randn(5), randn(3, 4), randn(4, 5)
    add(aten._addmm_activation.default, (bias, mat1, mat2), lambda *t: F.gelu(torch.addmm(*t)), (bias, mat1, mat2),
        use_gelu=True)
    for a, b, offs in grouped_mm_operands():
        add(aten._grouped_mm.default, (a, b, offs), grouped_mm_reference, (a, b, offs))
    return cases


@pytest.mark.parametrize("call", counted_by_flop_counter_matmul_calls(), ids=lambda c: str(c.op))
def test_matmul_rules_match_flop_counter_mode(call):
    """mm, addmm, bmm, baddbmm, _scaled_mm: FlopCounterMode is right for these."""
    counted, _ = counted_flops(call.op, *call.args, **call.kwargs)
    assert counted > 0
    assert rule_flops(call) == counted


@pytest.mark.parametrize("case", referenced_matmul_calls(), ids=lambda c: str(c[0].op))
def test_matmul_rules_match_mm_decomposition(case):
    """mv, addmv, dot, vdot, addr, addbmm, _int_mm, _weight_int8pack_mm, _addmm_activation,
    _grouped_mm: FlopCounterMode counts 0 for all of them (no formula, no
    decomposition under its mode). The reference recomputes the same result with mm/addmm (checked
    numerically) and FlopCounterMode counts those. addr is counted as addmm with k = 1 (each output is
    one fused multiply-add into ``self``)."""
    call, reference, reference_args = case
    counted, expected = counted_flops(reference, *reference_args)
    torch.testing.assert_close(call.result.to(expected.dtype).reshape(expected.shape), expected, rtol=1e-2,
                               atol=1e-2)
    assert rule_flops(call) == counted > 0


def test_scaled_grouped_mm_counts_like_grouped_mm():
    """_scaled_grouped_mm has no CPU kernel: run it on meta tensors and compare with the per-group mm
    loop on CPU tensors of the same shapes (FlopCounterMode counts 0 for it)."""
    fp8 = torch.float8_e4m3fn
    a, b = meta(3, 16, 32, dtype=fp8), meta(3, 16, 32, dtype=fp8).transpose(-1, -2)
    scales = meta(3, 16, dtype=torch.float32)
    call = run(aten._scaled_grouped_mm.default, a, b, scales, scales, out_dtype=torch.bfloat16)
    counted, _ = counted_flops(grouped_mm_reference, randn(3, 16, 32), randn(3, 32, 16), None)
    assert rule_flops(call) == counted


def trilinear_reference(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Brute-force _trilinear: per unrolled index, two einsum pair contractions (FlopCounterMode counts
    their bmm) or, for a pair summing nothing, an elementwise product counted as 1 FLOP per element.
    Returns (result, elementwise FLOPs)."""
    total_dim = i1.dim() + len(expand1)
    letters = "abcdefgh"[:total_dim]

    def unsqueezed(tensor, expanded):
        for dim in sorted(expanded):
            tensor = tensor.unsqueeze(dim)
        return tensor

    operands = [unsqueezed(t, e) for t, e in ((i1, expand1), (i2, expand2), (i3, expand3))]
    present = [[d not in e for d in range(total_dim)] for e in (expand1, expand2, expand3)]
    summed_12 = [d for d in sumdim if d != unroll_dim and not present[2][d]]
    summed_23 = [d for d in sumdim if d != unroll_dim and present[2][d]]

    def pair(left, left_dims, right, right_dims, summed):
        keep = [d for d in range(total_dim) if (d in left_dims or d in right_dims) and d not in summed]
        equation = (
            "".join(letters[d] for d in left_dims) + "," + "".join(letters[d] for d in right_dims)
            + "->" + "".join(letters[d] for d in keep)
        )
        product = torch.einsum(equation, left, right)
        return product, keep, (0 if summed else product.numel())

    def squeeze_to(tensor, dims):
        return tensor.squeeze(tuple(d for d in range(total_dim) if d not in dims))

    elementwise, slices = 0, []
    unroll_size = max(op.shape[unroll_dim] for op in operands)
    for index in range(unroll_size):
        parts = [op.narrow(unroll_dim, index if op.shape[unroll_dim] > 1 else 0, 1) for op in operands]
        dims = [[d for d in range(total_dim) if present[j][d] and d != unroll_dim] for j in range(3)]
        first, first_dims, first_extra = pair(
            squeeze_to(parts[0], dims[0]), dims[0], squeeze_to(parts[1], dims[1]), dims[1], summed_12)
        second, second_dims, second_extra = pair(first, first_dims, squeeze_to(parts[2], dims[2]), dims[2], summed_23)
        elementwise += first_extra + second_extra
        slices.append((second, second_dims))
    out_dims = [d for d in range(total_dim) if d not in sumdim]
    pieces = []
    for piece, dims in slices:
        for d in out_dims:
            if d not in dims:
                piece = piece.unsqueeze(out_dims.index(d))
        pieces.append(piece)
    if unroll_dim in sumdim:
        return sum(pieces), elementwise
    return torch.cat(pieces, dim=out_dims.index(unroll_dim)), elementwise


def bilinear_trilinear_calls() -> list[Call]:
    """The _trilinear calls of F.bilinear's forward and backward, for a few shapes."""
    calls = []
    for batch, in1, in2, out_features in [(3, 4, 5, 6), ((2, 3), 2, 7, 3), (5, 6, 6, 1)]:
        batch = batch if isinstance(batch, tuple) else (batch,)
        x1 = randn(*batch, in1).requires_grad_()
        x2 = randn(*batch, in2).requires_grad_()
        weight = randn(out_features, in1, in2).requires_grad_()
        bias = randn(out_features)

        def forward_backward():
            y = F.bilinear(x1, x2, weight, bias)
            y.backward(torch.randn_like(y))

        calls += recorded_calls(forward_backward)
    return calls


@pytest.mark.parametrize("call", bilinear_trilinear_calls(), ids=lambda c: str(c.args[3:7]))
def test_trilinear_matches_brute_force_einsum(call):
    """_trilinear (F.bilinear forward and backward): FlopCounterMode counts 0 (it neither has a formula
    nor sees the inner bmm calls). The reference replays ATen's pairwise algorithm with einsum; its bmm
    FLOPs come from FlopCounterMode and its elementwise products count 1 FLOP each."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in call.args)
    counted, (expected, elementwise) = counted_flops(trilinear_reference, *args)
    torch.testing.assert_close(call.result, expected)
    assert rule_flops(call) == counted + elementwise


def test_bilinear_forward_count_closed_form():
    """F.bilinear forward: 2·N·out·in1·in2 (x1·W[o], the bilinear form's own work) plus
    2·N·out·in2 (the row-wise dot with x2 that ATen's evaluation order adds)."""
    n, in1, in2, out_features = 3, 4, 5, 6
    calls = recorded_calls(F.bilinear, randn(n, in1), randn(n, in2), randn(out_features, in1, in2))
    assert [c.op for c in calls] == [aten._trilinear.default]
    assert rule_flops(calls[0]) == 2 * n * out_features * in2 * (in1 + 1)


# --------------------------------------------------------------------------------------------------
# convolution
# --------------------------------------------------------------------------------------------------


class ConvConfig(NamedTuple):
    batch: int
    in_channels: int
    out_channels: int
    spatial: tuple
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int
    transposed: bool = False
    output_padding: tuple = ()

    def operands(self):
        """(input, weight) with the layout of a (transposed) convolution."""
        x = randn(self.batch, self.in_channels, *self.spatial)
        if self.transposed:
            weight = randn(self.in_channels, self.out_channels // self.groups, *self.kernel)
        else:
            weight = randn(self.out_channels, self.in_channels // self.groups, *self.kernel)
        return x, weight

    def convolution_args(self, x, weight, bias=None):
        output_padding = list(self.output_padding) or [0] * len(self.spatial)
        return (x, weight, bias, list(self.stride), list(self.padding), list(self.dilation), self.transposed,
                output_padding, self.groups)


CONV_CONFIGS = [
    ConvConfig(2, 4, 6, (11,), (3,), (2,), (1,), (2,), 2),
    ConvConfig(2, 3, 4, (7, 8), (3, 2), (1, 2), (1, 0), (1, 2), 1),
    ConvConfig(1, 4, 8, (6, 5), (3, 3), (1, 1), (1, 1), (1, 1), 4),  # depthwise, channel multiplier 2
    ConvConfig(2, 3, 5, (6, 7), (2, 3), (2, 1), (0, 1), (1, 1), 1),
    ConvConfig(1, 4, 2, (4, 5, 3), (2, 3, 1), (1, 2, 1), (0, 1, 0), (1, 1, 1), 2),
    ConvConfig(1, 2, 3, (4, 5, 4), (2, 3, 2), (2, 1, 1), (1, 1, 0), (1, 1, 1), 1),
    ConvConfig(1, 2, 3, (5, 4, 6), (3, 2, 2), (1, 1, 2), (1, 0, 1), (2, 1, 1), 1),
    ConvConfig(1, 3, 3, (4, 4, 5), (2, 2, 2), (1, 1, 1), (1, 0, 1), (1, 1, 1), 3),  # depthwise 3d
    ConvConfig(2, 4, 6, (5,), (3,), (2,), (1,), (1,), 2, True, (1,)),
    ConvConfig(1, 3, 2, (4, 5), (3, 2), (2, 3), (1, 0), (1, 1), 1, True, (1, 2)),
    ConvConfig(2, 2, 4, (3, 4), (2, 3), (2, 1), (0, 1), (2, 2), 2, True, (1, 0)),
    ConvConfig(1, 2, 3, (3, 2, 4), (2, 2, 3), (1, 2, 2), (0, 1, 1), (1, 1, 1), 1, True, (0, 1, 1)),
]


def conv_id(config):
    kind = "convT" if config.transposed else "conv"
    return f"{kind}{len(config.spatial)}d-g{config.groups}"


def _windows(offset, dilation, stride, count):
    """Slices picking, per spatial dim, ``count`` positions ``offset·dilation + i·stride``."""
    return tuple(slice(o * d, o * d + (c - 1) * s + 1, s) for o, d, s, c in zip(offset, dilation, stride, count))


def conv_reference(x, weight, stride, padding, dilation, groups):
    """Convolution as im2col + one bmm per (sample, group): the dense work, zero padding included."""
    batch, in_channels, kernel = x.shape[0], x.shape[1], weight.shape[2:]
    padded = F.pad(x, [p for pad in reversed(padding) for p in (pad, pad)])
    out_sizes = [(padded.shape[2 + i] - dilation[i] * (k - 1) - 1) // stride[i] + 1 for i, k in enumerate(kernel)]
    offsets = list(itertools.product(*(range(k) for k in kernel)))
    columns = torch.stack([padded[(..., *_windows(o, dilation, stride, out_sizes))] for o in offsets], dim=2)
    columns = columns.reshape(batch * groups, in_channels // groups * len(offsets), -1)
    weights = weight.reshape(groups, weight.shape[0] // groups, -1).repeat(batch, 1, 1)
    return torch.bmm(weights, columns).reshape(batch, weight.shape[0], *out_sizes)


def conv_transpose_reference(x, weight, stride, padding, output_padding, dilation, groups):
    """Transposed convolution as one bmm per (sample, group) then column-to-image scatter-add."""
    batch, in_channels, in_sizes, kernel = x.shape[0], x.shape[1], x.shape[2:], weight.shape[2:]
    out_channels = weight.shape[1] * groups
    offsets = list(itertools.product(*(range(k) for k in kernel)))
    weights = weight.reshape(groups, in_channels // groups, -1).transpose(1, 2).repeat(batch, 1, 1)
    columns = torch.bmm(weights, x.reshape(batch * groups, in_channels // groups, -1))
    columns = columns.reshape(batch, out_channels, len(offsets), *in_sizes)
    full = [
        (n - 1) * s + d * (k - 1) + 1 + p for n, s, d, k, p in zip(in_sizes, stride, dilation, kernel, output_padding)
    ]
    image = x.new_zeros(batch, out_channels, *full)
    for index, offset in enumerate(offsets):
        window = (..., *_windows(offset, dilation, stride, in_sizes))
        image[window] = image[window] + columns[:, :, index]
    return image[(..., *(slice(p, size - p) for p, size in zip(padding, full)))]


def reference_conv(config, x, weight):
    if config.transposed:
        return conv_transpose_reference(x, weight, config.stride, config.padding, config.output_padding,
                                        config.dilation, config.groups)
    return conv_reference(x, weight, config.stride, config.padding, config.dilation, config.groups)


def reference_conv_flops(config):
    """FlopCounterMode's count of the im2col reference (bmm only), checked against the real op."""
    x, weight = config.operands()
    counted, expected = counted_flops(reference_conv, config, x, weight)
    torch.testing.assert_close(aten.convolution(*config.convolution_args(x, weight)), expected)
    return counted


@pytest.mark.parametrize("config", CONV_CONFIGS, ids=conv_id)
def test_convolution_matches_flop_counter_and_im2col(config):
    """convolution and _convolution, 1d/2d/3d, strided/padded/dilated, grouped/depthwise, transposed
    with output_padding: the rule, FlopCounterMode and the im2col reference all agree."""
    x, weight = config.operands()
    args = config.convolution_args(x, weight, randn(config.out_channels))
    expected = reference_conv_flops(config)
    counted, result = counted_flops(aten.convolution.default, *args)
    assert rule_flops(Call(aten.convolution.default, args, {}, result)) == counted == expected
    underscore_args = (*args, False, False, True, True)
    counted, result = counted_flops(aten._convolution.default, *underscore_args)
    assert rule_flops(Call(aten._convolution.default, underscore_args, {}, result)) == counted == expected


def backend_conv_calls() -> list[tuple[Call, int]]:
    """(call, reference FLOPs) for the backend kernels.

    CPU kernels run for real (their result is checked against aten.convolution). cuDNN/MIOpen/CUDA
    depthwise kernels and convolution_overrideable cannot run here (no CPU or meta kernel): they are
    given the arguments and the result of the equivalent aten.convolution."""
    cases = []
    for config in CONV_CONFIGS:
        x, weight = config.operands()
        expected = reference_conv_flops(config)
        conv_args = config.convolution_args(x, weight)
        reference_result = aten.convolution(*conv_args)
        stride, padding, dilation = list(config.stride), list(config.padding), list(config.dilation)
        kernel, groups, output_padding = list(config.kernel), config.groups, list(config.output_padding)
        rank, depthwise = len(kernel), groups == config.in_channels
        emulated = [(aten.convolution_overrideable.default, conv_args)]
        cpu = []
        if config.transposed:
            emulated.append((aten.cudnn_convolution_transpose.default,
                             (x, weight, padding, output_padding, stride, dilation, groups, False, False, False)))
            emulated.append((aten.miopen_convolution_transpose.default,
                             (x, weight, None, padding, output_padding, stride, dilation, groups, False, False)))
            if groups == 1 and rank > 1:
                slow = {2: aten.slow_conv_transpose2d, 3: aten.slow_conv_transpose3d}[rank]
                cpu.append((slow.default, (x, weight, kernel, None, stride, padding, output_padding, dilation)))
        else:
            emulated.append((aten.cudnn_convolution.default,
                             (x, weight, padding, stride, dilation, groups, True, False, False)))
            emulated.append((aten.miopen_convolution.default,
                             (x, weight, None, padding, stride, dilation, groups, False, False)))
            if depthwise:
                emulated.append((aten.miopen_depthwise_convolution.default,
                                 (x, weight, None, padding, stride, dilation, groups, False, False)))
            if depthwise and rank > 1:
                cuda_depthwise = {2: aten._conv_depthwise2d, 3: aten.conv_depthwise3d}[rank]
                emulated.append((cuda_depthwise.default, (x, weight, kernel, None, stride, padding, dilation)))
            cpu.append((aten.mkldnn_convolution.default,
                        (x.float(), weight.float(), None, padding, stride, dilation, groups)))
            if groups == 1 and rank > 1:
                dilated = {2: aten.slow_conv_dilated2d, 3: aten.slow_conv_dilated3d}[rank]
                cpu.append((dilated.default, (x, weight, kernel, None, stride, padding, dilation)))
            if groups == 1 and rank > 1 and all(d == 1 for d in dilation):
                slow = {2: aten._slow_conv2d_forward, 3: aten.slow_conv3d_forward}[rank]
                cpu.append((slow.default, (x, weight, kernel, None, stride, padding)))
        for op, args in emulated:
            cases.append((Call(op, args, {}, reference_result), expected))
        for op, args in cpu:
            call = run(op, *args)
            torch.testing.assert_close(call.result.double(), reference_result, rtol=1e-4, atol=1e-4)
            cases.append((call, expected))
    return cases


@pytest.mark.parametrize("case", backend_conv_calls(), ids=lambda c: str(c[0].op))
def test_backend_convolutions_match_im2col(case):
    """Backend kernels (mkldnn, slow_conv*, cuDNN, MIOpen, CUDA depthwise, overrideable) count as the
    convolution they compute. FlopCounterMode mis-handles two of them (it applies the ``convolution``
    signature): _slow_conv2d_forward raises TypeError, cudnn_convolution with benchmark=True is read as
    a transposed convolution."""
    call, expected = case
    assert rule_flops(call) == expected


def test_flop_counter_conv_formula_matches_cudnn_rule_without_benchmark():
    """FlopCounterMode's registered cudnn_convolution formula agrees with the rule when its 7th
    argument (``benchmark``, which it takes for ``transposed``) is False."""
    config = CONV_CONFIGS[1]
    x, weight = config.operands()
    args = (x, weight, list(config.padding), list(config.stride), list(config.dilation), 1, False, False, False)
    result = aten.convolution(*config.convolution_args(x, weight))
    expected = flop_registry[aten.cudnn_convolution](*args, out_val=result)
    assert rule_flops(Call(aten.cudnn_convolution.default, args, {}, result)) == expected


OUTPUT_MASKS = [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]


def reference_conv_backward_flops(config, x, weight, grad_output, output_mask):
    """FlopCounterMode's count of autograd through the im2col reference, which needs one bmm per
    requested gradient (grad_input: weightsᵀ·grad, grad_weight: grad·columnsᵀ)."""
    x = x.detach().requires_grad_(output_mask[0])
    weight = weight.detach().requires_grad_(output_mask[1])
    inputs = [t for t in (x, weight) if t.requires_grad]
    if not inputs:
        return 0
    y = reference_conv(config, x, weight)
    counted, _ = counted_flops(torch.autograd.grad, y, inputs, grad_output)
    return counted


@pytest.mark.parametrize("output_mask", OUTPUT_MASKS, ids=str)
@pytest.mark.parametrize("config", CONV_CONFIGS, ids=conv_id)
def test_convolution_backward_matches_im2col_autograd(config, output_mask):
    """convolution_backward (and _overrideable): grad_input and grad_weight each cost the forward.
    FlopCounterMode is right for groups = 1 but multiplies the grad_weight term by ``groups`` (it
    transposes batch/channel dims of a grouped conv as if ungrouped), so the reference is autograd
    through the im2col bmm form instead."""
    x, weight = config.operands()
    out = aten.convolution(*config.convolution_args(x, weight))
    grad_output = torch.randn_like(out)
    expected = reference_conv_backward_flops(config, x, weight, grad_output, output_mask)
    conv = config.convolution_args(x, weight)
    args = (grad_output, x, weight, [config.out_channels], *conv[3:], list(output_mask))
    call = run(aten.convolution_backward.default, *args)
    assert rule_flops(call) == expected
    if config.groups == 1:
        counted, _ = counted_flops(aten.convolution_backward.default, *args)
        assert counted == expected
    overrideable = Call(aten.convolution_backward_overrideable.default,
                        (grad_output, x, weight, *conv[3:], list(output_mask)), {}, call.result)
    assert rule_flops(overrideable) == expected


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------


class AttentionShape(NamedTuple):
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    qk_dim: int
    v_dim: int
    causal: bool = False

    def heads_first(self, make=randn, requires_grad=False):
        """(B,H,S,D) query, key, value."""
        tensors = (
            make(self.batch, self.q_heads, self.q_len, self.qk_dim),
            make(self.batch, self.kv_heads, self.kv_len, self.qk_dim),
            make(self.batch, self.kv_heads, self.kv_len, self.v_dim),
        )
        return tuple(t.requires_grad_(requires_grad) for t in tensors)

    def forward(self):
        return 2 * self.batch * self.q_heads * self.q_len * self.kv_len * (self.qk_dim + self.v_dim)

    def backward(self):
        return 2 * self.batch * self.q_heads * self.q_len * self.kv_len * (3 * self.qk_dim + 2 * self.v_dim)


CPU_ATTENTION_SHAPES = [
    AttentionShape(2, 4, 2, 6, 5, 8, 8),  # GQA, Sq != Sk
    AttentionShape(1, 3, 3, 7, 7, 4, 4, causal=True),
    AttentionShape(2, 6, 2, 3, 9, 16, 16),
]
META_ATTENTION_SHAPES = CPU_ATTENTION_SHAPES + [AttentionShape(2, 4, 4, 6, 10, 8, 16)]


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def math_sdpa_reference(shape):
    """(forward, fused-backward) FLOPs of the MATH backend, which runs SDPA as bmm (counted by
    FlopCounterMode). Its backward (dV, dP, dQ, dK) lacks the recomputation of Q·Kᵀ that fused kernels
    do, so one counted Q·Kᵀ matmul is added to it."""
    q, k, v = shape.heads_first(requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH):
        forward, out = counted_flops(sdpa, q, k, v, shape.causal)
        backward, _ = counted_flops(torch.autograd.grad, out, (q, k, v), torch.randn_like(out))
    expanded_k = k.detach().repeat_interleave(shape.q_heads // shape.kv_heads, dim=1)
    recompute, _ = counted_flops(torch.matmul, q.detach(), expanded_k.transpose(-1, -2))
    return forward, backward + recompute


@pytest.mark.parametrize("shape", CPU_ATTENTION_SHAPES, ids=str)
def test_cpu_flash_attention_matches_math_backend(shape):
    """_scaled_dot_product_flash_attention_for_cpu and its backward (F.sdpa on CPU, GQA included):
    FlopCounterMode counts 0 for both (no formula). Reference: the MATH backend's bmm count, plus the
    Q·Kᵀ recomputation for the fused backward."""
    q, k, v = shape.heads_first(requires_grad=True)

    def forward_backward():
        out = sdpa(q, k, v, shape.causal)
        out.backward(torch.randn_like(out))

    calls = recorded_calls(forward_backward)
    assert [c.op for c in calls] == [
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ]
    forward, backward = math_sdpa_reference(shape)
    assert rule_flops(calls[0]) == forward == shape.forward()
    assert rule_flops(calls[1]) == backward == shape.backward()


def meta_sdpa_calls(shape) -> list[Call]:
    """The CUDA SDPA kernels and their backward, run on meta tensors (they need CUDA for real)."""
    q, k, v = shape.heads_first(make=meta)
    dropout, causal = 0.0, shape.causal
    grad = meta(shape.batch, shape.q_heads, shape.q_len, shape.v_dim)
    out = meta(shape.batch, shape.q_heads, shape.q_len, shape.v_dim)
    lse = meta(shape.batch, shape.q_heads, shape.q_len, dtype=torch.float32)
    seed, offset = meta((), dtype=torch.int64), meta((), dtype=torch.int64)
    calls = [
        run(aten._scaled_dot_product_efficient_attention.default, q, k, v, None, True, dropout, causal),
        run(aten._scaled_dot_product_efficient_attention_backward.default, grad, q, k, v, None, out, lse, seed,
            offset, dropout, [True, True, True, False], causal),
        run(aten._scaled_dot_product_cudnn_attention.default, q, k, v, None, True, dropout, causal),
        run(aten._scaled_dot_product_cudnn_attention_backward.default, grad, q, k, v, out, lse[..., None], seed,
            offset, None, None, None, shape.q_len, shape.kv_len, dropout, causal),
    ]
    if shape.qk_dim == shape.v_dim:
        rng = meta(2, dtype=torch.int64)
        calls += [
            run(aten._scaled_dot_product_flash_attention.default, q, k, v, dropout, causal),
            run(aten._scaled_dot_product_flash_attention_backward.default, grad, q, k, v, out, lse, None, None,
                shape.q_len, shape.kv_len, dropout, causal, rng, meta(0)),
        ]
    return calls


def meta_overrideable_calls(shape) -> list[Call]:
    """The PrivateUse1 ``fused_attention_overrideable`` forward and backward, on meta tensors."""
    q, k, v = shape.heads_first(make=meta)
    grad = meta(shape.batch, shape.q_heads, shape.q_len, shape.v_dim)
    lse = meta(shape.batch, shape.q_heads, shape.q_len, dtype=torch.float32)
    seed = meta((), dtype=torch.int64)
    return [
        run(aten._scaled_dot_product_fused_attention_overrideable.default, q, k, v, is_causal=shape.causal),
        run(aten._scaled_dot_product_fused_attention_overrideable_backward.default, grad, q, k, v, None,
            [True, True, True, False], grad, lse, None, None, shape.q_len, shape.kv_len, 0.0, shape.causal, seed,
            seed),
    ]


@pytest.mark.parametrize("shape", META_ATTENTION_SHAPES, ids=str)
def test_cuda_sdpa_kernels_match_flop_counter_mode(shape):
    """flash/efficient/cuDNN SDPA and their backward, on meta tensors: FlopCounterMode is right for
    these (forward 4·B·H·Sq·Sk·D, backward 2.5× for equal head dims)."""
    for call in meta_sdpa_calls(shape):
        counted, _ = counted_flops(call.op, *call.args, **call.kwargs)
        expected = shape.backward() if "backward" in str(call.op) else shape.forward()
        assert rule_flops(call) == counted == expected


@pytest.mark.parametrize("shape", META_ATTENTION_SHAPES, ids=str)
def test_overrideable_sdpa_matches_flop_counter_formulas(shape):
    """_scaled_dot_product_fused_attention_overrideable (+ backward): FlopCounterMode has no formula
    (counts 0); the reference is its own sdpa_flop_count / sdpa_backward_flop_count on the shapes."""
    forward, backward = meta_overrideable_calls(shape)
    q, k, v = (a.shape for a in forward.args[:3])
    assert rule_flops(forward) == sdpa_flop_count(q, k, v)
    assert rule_flops(backward) == sdpa_backward_flop_count(backward.args[0].shape, q, k, v)


def raw_dense_attention_calls(shape) -> list[Call]:
    """Raw flash/efficient kernels on dense (B,S,H,D) meta tensors, forward and backward."""
    q, k, v = (t.transpose(1, 2) for t in shape.heads_first(make=meta))
    grad = meta(shape.batch, shape.q_len, shape.q_heads, shape.v_dim)
    lse = meta(shape.batch, shape.q_heads, shape.q_len, dtype=torch.float32)
    seed = meta((), dtype=torch.int64)
    calls = [
        run(aten._efficient_attention_forward.default, q, k, v, None, None, None, shape.q_len, shape.kv_len, 0.0, 0),
        run(aten._efficient_attention_backward.default, grad, q, k, v, None, grad, None, None, shape.q_len,
            shape.kv_len, lse, 0.0, seed, seed, 0, False),
    ]
    if shape.qk_dim == shape.v_dim:
        rng = meta(2, dtype=torch.int64)
        calls += [
            run(aten._flash_attention_forward.default, q, k, v, None, None, shape.q_len, shape.kv_len, 0.0,
                shape.causal, False),
            run(aten._flash_attention_backward.default, grad, q, k, v, grad, lse, None, None, shape.q_len,
                shape.kv_len, 0.0, shape.causal, rng, meta(0)),
        ]
    return calls


@pytest.mark.parametrize("shape", META_ATTENTION_SHAPES, ids=str)
def test_raw_dense_attention_reads_sequence_first_layout(shape):
    """_flash_attention_* / _efficient_attention_* on dense (B,S,H,D) inputs: FlopCounterMode reads
    them as (B,H,S,D) (wrong count, or an AssertionError when Sq is no multiple of Sk). Reference:
    FlopCounterMode's own formulas on the (B,H,S,D) transposes."""
    for call in raw_dense_attention_calls(shape):
        if "backward" in str(call.op):
            grad, q, k, v = (a.transpose(1, 2).shape for a in call.args[:4])
            assert rule_flops(call) == sdpa_backward_flop_count(grad, q, k, v) == shape.backward()
        else:
            q, k, v = (a.transpose(1, 2).shape for a in call.args[:3])
            assert rule_flops(call) == sdpa_flop_count(q, k, v) == shape.forward()


def varlen_attention_calls() -> list[Call]:
    """Raw flash/efficient kernels with packed varlen inputs (cumulative offsets), on meta tensors."""
    total, heads, dim = 11, 4, 8
    offsets = meta(3, dtype=torch.int32)
    packed = meta(total, heads, dim)
    batched = meta(1, total, heads, dim)
    lse = meta(heads, total, dtype=torch.float32)
    seed, rng = meta((), dtype=torch.int64), meta(2, dtype=torch.int64)
    return [
        run(aten._flash_attention_forward.default, packed, packed, packed, offsets, offsets, 6, 6, 0.0, False, False),
        run(aten._flash_attention_backward.default, packed, packed, packed, packed, packed, lse, offsets, offsets,
            6, 6, 0.0, False, rng, meta(0)),
        run(aten._efficient_attention_forward.default, batched, batched, batched, None, offsets, offsets, 6, 6,
            0.0, 0),
        run(aten._efficient_attention_backward.default, batched, batched, batched, batched, None, batched, offsets,
            offsets, 6, 6, meta(1, heads, total, dtype=torch.float32), 0.0, seed, seed, 0, False),
    ]


@pytest.mark.parametrize("call", varlen_attention_calls(), ids=lambda c: str(c.op))
def test_varlen_attention_counts_per_segment(call):
    """Packed varlen attention costs 2·Hq·(Dqk + Dv)·Σᵢ sᵢ² forward (2·Hq·(3·Dqk + 2·Dv)·Σᵢ sᵢ²
    backward): the rule receives the offsets' segment family and returns a multiple of its p₂.
    Reference: the per-segment dense formula summed by brute force over offsets [0, 5, 11].
    (FlopCounterMode reads the offsets with .tolist(), a host sync, or assumes max length on fakes.)"""
    family = Family(Lengths(Rows(("cu",), ELEMENT, diff=True)), "cu")
    lengths = SegmentLengths(family, set())
    positions = segment_args(call.op)
    args = [lengths if i in positions else a for i, a in enumerate(shape_of(call.args))]
    flops = rule_for(call.op)(*args, out_shape=shape_of(call.result), **shape_of(call.kwargs))
    heads, dim = 4, 8
    per_pair = 2 * heads * (dim + dim) if "backward" not in str(call.op) else 2 * heads * (3 * dim + 2 * dim)
    brute_force = sum(per_pair * s * s for s in (5, 6))
    assert flops.subs(family.power_sum(2), 5**2 + 6**2) == brute_force


def test_paged_flash_attention_raises_clear_error():
    """A block_table (paged KV cache) hides the key length from the shapes: the rule refuses."""
    q, k, v = AttentionShape(2, 4, 4, 6, 5, 8, 8).heads_first(make=meta)
    call = Call(aten._flash_attention_forward.default, (q, k, v, None, None, 6, 5, 0.0, False, False),
                {"block_table": meta(2, 3, dtype=torch.int32)}, (q,))
    with pytest.raises(ValueError, match="page table"):
        rule_flops(call)


FLEX_SHAPES = [AttentionShape(2, 4, 2, 6, 5, 8, 16), AttentionShape(1, 2, 2, 8, 8, 4, 4, causal=True)]


def flex_attention_calls(shape) -> list[Call]:
    """The flex_attention HOP node of a make_fx trace, with its traced arguments (fake tensors)."""
    q, k, v = shape.heads_first()
    kwargs = {"enable_gqa": shape.q_heads != shape.kv_heads}
    if shape.causal:
        kwargs["block_mask"] = create_block_mask(
            lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, shape.q_len, shape.kv_len, device="cpu")
        kwargs["score_mod"] = lambda score, b, h, q_idx, kv_idx: score * 2
    graph = make_fx(lambda q, k, v: flex_attention(q, k, v, **kwargs))(q, k, v)
    calls = []
    for node in graph.graph.nodes:
        if node.target is torch.ops.higher_order.flex_attention:
            args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val", n))
            calls.append(Call(node.target, args, {}, node.meta["val"]))
    return calls


@pytest.mark.parametrize("shape", FLEX_SHAPES, ids=str)
def test_flex_attention_matches_flop_counter_formula_and_math(shape):
    """flex_attention: FlopCounterMode cannot run eager flex attention on CPU (TypeError from the HOP
    under its mode), so the traced HOP node is checked against FlopCounterMode's registered formula on
    the same arguments and against the MATH backend's bmm count (dense, score_mod/block mask ignored)."""
    (call,) = flex_attention_calls(shape)
    formula = flop_registry[torch.ops.higher_order.flex_attention]
    forward, _ = math_sdpa_reference(shape._replace(causal=False))
    assert rule_flops(call) == formula(*call.args, out_val=call.result) == forward == shape.forward()


@pytest.mark.parametrize("shape", FLEX_SHAPES, ids=str)
def test_flex_attention_backward_matches_flop_counter_formula_and_math(shape):
    """flex_attention_backward (CPU has no flex backward): the rule on meta shapes against
    FlopCounterMode's registered formula and the MATH backend's backward + Q·Kᵀ recompute."""
    q, k, v = shape.heads_first(make=meta)
    out = meta(shape.batch, shape.q_heads, shape.q_len, shape.v_dim)
    lse = meta(shape.batch, shape.q_heads, shape.q_len, dtype=torch.float32)
    args = (q, k, v, out, lse, out, None, None, None, (), 1.0, {})
    call = Call(torch.ops.higher_order.flex_attention_backward, args, {}, (q, k, v, ()))
    formula = flop_registry[torch.ops.higher_order.flex_attention_backward]
    _, backward = math_sdpa_reference(shape._replace(causal=False))
    assert rule_flops(call) == formula(*args, out_val=call.result) == backward == shape.backward()


# --------------------------------------------------------------------------------------------------
# every rule: symbolic == concrete, coverage
# --------------------------------------------------------------------------------------------------


def all_calls() -> list[Call]:
    """At least one call for every op with a rule in the three modules."""
    calls = counted_by_flop_counter_matmul_calls()
    calls += [case[0] for case in referenced_matmul_calls()]
    calls += bilinear_trilinear_calls()
    fp8 = torch.float8_e4m3fn
    scales = meta(3, 16, dtype=torch.float32)
    calls.append(run(aten._scaled_grouped_mm.default, meta(3, 16, 32, dtype=fp8),
                     meta(3, 16, 32, dtype=fp8).transpose(-1, -2), scales, scales, out_dtype=torch.bfloat16))
    for config in CONV_CONFIGS:
        x, weight = config.operands()
        conv = config.convolution_args(x, weight)
        forward = run(aten.convolution.default, *conv)
        grad_output = torch.randn_like(forward.result)
        calls += [
            forward,
            Call(aten._convolution.default, (*conv, False, False, True, True), {}, forward.result),
            run(aten.convolution_backward.default, grad_output, x, weight, None, *conv[3:], [True, True, False]),
            Call(aten.convolution_backward_overrideable.default, (grad_output, x, weight, *conv[3:],
                                                                  [True, False, False]), {}, (x, None, None)),
        ]
    calls += [case[0] for case in backend_conv_calls()]
    for shape in META_ATTENTION_SHAPES[:1] + META_ATTENTION_SHAPES[-1:]:
        calls += meta_sdpa_calls(shape) + meta_overrideable_calls(shape) + raw_dense_attention_calls(shape)
    q, k, v = CPU_ATTENTION_SHAPES[0].heads_first(requires_grad=True)
    calls += recorded_calls(lambda: sdpa(q, k, v, False).sum().backward())
    shape = FLEX_SHAPES[0]
    calls += flex_attention_calls(shape)
    q, k, v = shape.heads_first(make=meta)
    out = meta(shape.batch, shape.q_heads, shape.q_len, shape.v_dim)
    calls.append(Call(torch.ops.higher_order.flex_attention_backward,
                      (q, k, v, out, meta(2, 4, 6), out, None, None, None, (), 1.0, {}), {}, (q, k, v, ())))
    return calls


ALL_CALLS = all_calls()


def test_every_rule_has_a_call():
    """Each op registered by matmul/conv/attention appears in ALL_CALLS (so the symbolic test sees it)."""
    ours = {op for op in registered_ops() if rule_for(op).__module__ in RULE_MODULES}
    seen = {getattr(call.op, "overloadpacket", call.op) for call in ALL_CALLS}
    assert ours - seen == set()


def symbolic_shape_of(value, symbols):
    """``shape_of`` with every nonzero size replaced by a positive integer symbol named after it."""
    if isinstance(value, torch.Tensor):
        return tuple(
            symbols.setdefault(size, sympy.Symbol(f"d{size}", positive=True, integer=True)) if size else 0
            for size in value.shape
        )
    if isinstance(value, (list, tuple)):
        return type(value)(symbolic_shape_of(v, symbols) for v in value)
    if isinstance(value, dict):
        return {key: symbolic_shape_of(v, symbols) for key, v in value.items()}
    return value


@pytest.mark.parametrize("call", ALL_CALLS, ids=lambda c: str(c.op))
def test_rule_symbolic_equals_concrete(call):
    """Fed sympy symbols instead of sizes, every rule gives a polynomial that equals the int result
    once the symbols are substituted by the sizes."""
    symbols: dict[int, sympy.Symbol] = {}
    concrete = rule_flops(call)
    expression = rule_for(call.op)(
        *symbolic_shape_of(call.args, symbols), out_shape=symbolic_shape_of(call.result, symbols),
        **symbolic_shape_of(call.kwargs, symbols),
    )
    assert type(concrete) is int and concrete > 0
    expression = sympy.sympify(expression)
    assert expression.free_symbols <= set(symbols.values())
    assert expression.is_polynomial(*symbols.values())
    assert expression.subs({symbol: size for size, symbol in symbols.items()}) == concrete


def test_symbolic_sequence_length_gives_polynomial():
    """A symbolic sequence length turns attention into c·s² and a convolution into a polynomial in s."""
    s = sympy.Symbol("s", positive=True, integer=True)
    attention = rule_for(aten._scaled_dot_product_flash_attention_for_cpu)((2, 4, s, 8), (2, 2, s, 8), (2, 2, s, 8))
    assert sympy.expand(attention - 4 * 2 * 4 * 8 * s**2) == 0
    backward = rule_for(aten._scaled_dot_product_flash_attention_backward)(
        (2, 4, s, 8), (2, 4, s, 8), (2, 2, s, 8), (2, 2, s, 8))
    assert sympy.expand(backward - sympy.Rational(5, 2) * attention) == 0
    conv = rule_for(aten.convolution)((1, 3, s, s), (8, 3, 3, 3), None, [1, 1], [1, 1], [1, 1], False,
                                      out_shape=(1, 8, s, s))
    assert sympy.Poly(conv, s).all_coeffs() == [2 * 8 * 27, 0, 0]
    mm = rule_for(aten.mm)((s, 64), (64, s + 1))
    assert sympy.Poly(mm, s).all_coeffs() == [128, 128, 0]


def test_math_of_hand_formulas():
    """Spot values worked by hand, independent of any counter."""
    assert rule_for(aten.addr)((3, 4), (3,), (4,)) == 24
    assert rule_for(aten._grouped_mm)((4, 24), (24, 8), (3,)) == 2 * 4 * 24 * 8
    assert rule_for(aten._grouped_mm)((3, 4, 8), (8, 20), (3,)) == 2 * 4 * 8 * 20
    assert rule_for(aten.convolution_backward)(
        (2, 8, 5, 5), (2, 4, 7, 7), (8, 1, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 4,
        [True, True, False]) == 2 * (2 * 2 * 8 * 1 * 9 * 25)  # (grad_input + grad_weight) × forward
    assert math.isclose(
        rule_for(aten._scaled_dot_product_efficient_attention_backward)(
            (1, 2, 3, 8), (1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)
        ) / rule_for(aten._scaled_dot_product_efficient_attention)((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)),
        2.5,
    )


class _Bag(torch.nn.Module):
    """A weighted gather from a table (interpolation taps of a position table, as Kimi-K2.5's)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, indices, weights):
        return F.embedding_bag(indices, self.table, per_sample_weights=weights, mode="sum")


def test_embedding_bag_is_elementwise_work():
    """Not a matmul (FlopCounterMode counts 0: the default convention too); under count="all" a
    multiply and an add per gathered element (6 bags x 4 taps x width 8), and in training the table's
    gradient as much again plus a width-8 dot product per tap for the weights' gradient."""
    import fxflops
    from fxflops.conventions import FLOPCOUNTER

    model, everything = _Bag(), FLOPCOUNTER.but(count="all")
    indices, weights = torch.randint(0, 16, (6, 4)), torch.rand(6, 4, requires_grad=True)
    wrapper = fxflops.instrument(model, dims={"indices": {0: "bags"}, "weights": {0: "bags"}}, backward=True, strict=True)
    wrapper(indices, weights).sum().backward()
    with FlopCounterMode(display=False) as reference:
        model(indices, weights).sum().backward()
    assert wrapper.flops.total() == reference.get_total_flops() == 0
    assert not wrapper.program.unsupported
    gathered = 6 * 4 * 8
    assert wrapper.flops.total("fwd", convention=everything) == 2 * gathered
    assert wrapper.flops.total("bwd", convention=everything) == 2 * gathered + 2 * gathered
