"""FLOPs rules for matrix and vector products.

Convention (as ``torch.utils.flop_counter``): one multiply-add = 2 FLOPs, so a contraction of length
``k`` producing one output element costs ``2·k``. The elementwise ``beta·self + alpha·(...)`` of the
``add*`` ops and any bias are not counted: the product accumulates into them. Complex dtypes are
counted in the dtype's own arithmetic (one complex multiply-add = 2 FLOPs), as FlopCounterMode does.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch

from fxflops.rules.registry import register

aten = torch.ops.aten


def _product(sizes: Sequence[Any]) -> Any:
    """Product of ``sizes`` (ints or sympy expressions); 1 for an empty sequence."""
    return functools.reduce(operator.mul, sizes, 1)


@register(aten.mm, aten._int_mm, aten._scaled_mm)
def mm(self, mat2, *args, out_shape=None, **kwargs):
    """mm, _int_mm, _scaled_mm: (m,k)@(k,n) -> 2·m·k·n.

    Scales, bias and the output dtype of the scaled/int forms do not change the product's work.
    Source: torch/utils/flop_counter.py ``mm_flop`` (FlopCounterMode counts 0 for _int_mm).
    """
    rows, inner = self
    return 2 * rows * inner * mat2[1]


@register(aten.addmm, aten._addmm_activation)
def addmm(self, mat1, mat2, *args, out_shape=None, **kwargs):
    """addmm, _addmm_activation: beta·self + alpha·(m,k)@(k,n) -> 2·m·k·n.

    The add into ``self`` and the fused GELU/ReLU of _addmm_activation are not counted.
    Source: torch/utils/flop_counter.py ``addmm_flop`` (FlopCounterMode counts 0 for _addmm_activation).
    """
    return mm(mat1, mat2)


@register(aten._weight_int8pack_mm)
def weight_int8pack_mm(self, mat2, *args, out_shape=None, **kwargs):
    """_weight_int8pack_mm: (m,k) @ int8 weight stored (n,k), transposed -> 2·m·k·n.

    Per-channel ``scales`` are applied to the (m,n) result and not counted.
    Source: torch/_meta_registrations.py ``meta__weight_int8pack_mm`` (weight is (n,k)); FlopCounterMode
    counts 0.
    """
    rows, inner = self
    return 2 * rows * inner * mat2[0]


@register(aten.bmm)
def bmm(self, mat2, *args, out_shape=None, **kwargs):
    """bmm: (b,m,k)@(b,k,n) -> 2·b·m·k·n.

    Source: torch/utils/flop_counter.py ``bmm_flop``.
    """
    batch, rows, inner = self
    return 2 * batch * rows * inner * mat2[2]


@register(aten.baddbmm)
def baddbmm(self, batch1, batch2, *args, out_shape=None, **kwargs):
    """baddbmm: beta·self + alpha·(b,m,k)@(b,k,n) -> 2·b·m·k·n.

    Source: torch/utils/flop_counter.py ``baddbmm_flop``.
    """
    return bmm(batch1, batch2)


@register(aten.addbmm)
def addbmm(self, batch1, batch2, *args, out_shape=None, **kwargs):
    """addbmm: beta·self + alpha·Σ_b (b,m,k)@(b,k,n) -> 2·b·m·k·n.

    The sum over the batch accumulates into the same (m,n) output, i.e. it is one (m, b·k)@(b·k, n)
    product. Source: torch.addbmm docs; FlopCounterMode counts 0 for it.
    """
    return bmm(batch1, batch2)


@register(aten.mv)
def mv(self, vec, *args, out_shape=None, **kwargs):
    """mv: (m,n)@(n) -> 2·m·n. Source: same as mm with one column; FlopCounterMode counts 0."""
    rows, cols = self
    return 2 * rows * cols


@register(aten.addmv)
def addmv(self, mat, vec, *args, out_shape=None, **kwargs):
    """addmv: beta·self + alpha·(m,n)@(n) -> 2·m·n. Source: mv; FlopCounterMode counts 0."""
    return mv(mat, vec)


@register(aten.dot)
def dot(self, tensor, *args, out_shape=None, **kwargs):
    """dot: (n)·(n) -> 2·n. Source: mm with m = n_out = 1; FlopCounterMode counts 0."""
    return 2 * self[0]


@register(aten.vdot)
def vdot(self, other, *args, out_shape=None, **kwargs):
    """vdot: conj(n)·(n) -> 2·n (the conjugation is free). Source: dot; FlopCounterMode counts 0."""
    return 2 * self[0]


@register(aten.addr)
def addr(self, vec1, vec2, *args, out_shape=None, **kwargs):
    """addr: beta·self + alpha·outer((n), (m)) -> 2·n·m.

    Each output element is one multiply ``vec1[i]·vec2[j]`` fused with the add into ``self``, i.e. one
    multiply-add, so addr counts exactly as ``addmm(self, vec1[:, None], vec2[None, :])`` (k = 1) and
    rewriting one into the other does not change the total. Source: FMA convention of mm_flop;
    FlopCounterMode counts 0.
    """
    return 2 * vec1[0] * vec2[0]


@register(aten._grouped_mm, aten._scaled_grouped_mm)
def grouped_mm(self, mat2, *args, out_shape=None, **kwargs):
    """_grouped_mm, _scaled_grouped_mm: G independent products, 2·Σ_g m_g·k_g·n_g.

    By the ranks of (self, mat2):
      3D×3D (G,m,k)@(G,k,n), no offs        -> 2·G·m·k·n
      2D×3D (M,k)@(G,k,n), offs split M     -> 2·M·k·n
      3D×2D (G,m,k)@(k,N), offs split N     -> 2·m·k·N
      2D×2D (m,K)@(K,n) -> (G,m,n), offs split K -> 2·m·K·n
    The data of ``offs`` is not read: the groups are counted as covering the whole ragged dimension
    (offs[-1] equal to its size). If a graph leaves trailing rows out, this is an upper bound.
    Source: aten/src/ATen/native/GroupedMMUtils.h ``_grouped_mm_fallback``; FlopCounterMode counts 0.
    """
    if len(self) == 3 and len(mat2) == 2:
        return 2 * self[1] * self[2] * mat2[1]
    return 2 * _product(self) * mat2[-1]


def _trilinear_dim_sizes(tensor, expanded, total_dim):
    """Sizes of ``tensor`` after unsqueezing at ``expanded``: ``None`` marks a broadcast (absent) dim."""
    remaining = iter(tensor)
    return [None if dim in expanded else next(remaining) for dim in range(total_dim)]


def _sumproduct_pair_flops(left, right, summed):
    """FLOPs of ATen's ``sumproduct_pair(left, right, summed)`` on per-dim sizes (``None`` = absent).

    With no summed dim it is an elementwise ``mul``: 1 FLOP per product. Otherwise it is one bmm over
    the joint index space of both operands (2 FLOPs per multiply-add), except that a summed dim present
    in only one operand is reduced beforehand (additions only), so it does not multiply the work.
    """
    points = 1
    for dim, (left_size, right_size) in enumerate(zip(left, right)):
        one_sided = left_size is None or right_size is None
        if dim in summed and one_sided:
            continue
        size = right_size if left_size is None else left_size
        points = points * (1 if size is None else size)
    return 2 * points if summed else points


@register(aten._trilinear)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1, *args, out_shape=None, **kwargs):
    """_trilinear: the two contractions ATen really runs, summed over the unrolled dimension.

    ``out = (i1.unsqueeze(expand1)·i2.unsqueeze(expand2)·i3.unsqueeze(expand3)).sum(sumdim)`` is
    computed, for each index of ``unroll_dim``, as ``sumproduct_pair(i1, i2, dims summed where i3 is
    broadcast)`` and then ``sumproduct_pair(that, i3, the other summed dims)``; each pair is one bmm
    (2 FLOPs per multiply-add), or an elementwise mul (1 FLOP per product) when it sums nothing.
    For ``F.bilinear`` (x1 (N,in1), x2 (N,in2), W (out,in1,in2)) this is 2·N·out·in1·in2 (x1·W[o])
    + 2·N·out·in2 (row-wise dot with x2) = 2·N·out·in2·(in1 + 1); its backward's three _trilinear
    calls cost 3·N·out·in1·in2 (grad x1), 2·N·out·in1·in2 + N·out·in1 (grad W) and
    2·N·out·in1·in2 + N·out·in2 (grad x2).
    Source: aten/src/ATen/native/Linear.cpp ``_trilinear`` and ``sumproduct_pair``; FlopCounterMode
    counts 0.
    """
    total_dim = len(i1) + len(expand1)
    sizes1 = _trilinear_dim_sizes(i1, {dim % total_dim for dim in expand1}, total_dim)
    sizes2 = _trilinear_dim_sizes(i2, {dim % total_dim for dim in expand2}, total_dim)
    sizes3 = _trilinear_dim_sizes(i3, {dim % total_dim for dim in expand3}, total_dim)
    sumdim = {dim % total_dim for dim in sumdim}
    unroll_size = next(s for s in (sizes3[unroll_dim], sizes2[unroll_dim], sizes1[unroll_dim]) if s is not None)
    for sizes in (sizes1, sizes2, sizes3):
        sizes[unroll_dim] = None
    summed_12 = {dim for dim in sumdim if dim != unroll_dim and sizes3[dim] is None}
    summed_23 = {dim for dim in sumdim if dim != unroll_dim and sizes3[dim] is not None}
    sizes12 = [
        None if dim in summed_12 else (size2 if size2 is not None else size1)
        for dim, (size1, size2) in enumerate(zip(sizes1, sizes2))
    ]
    first = _sumproduct_pair_flops(sizes1, sizes2, summed_12)
    second = _sumproduct_pair_flops(sizes12, sizes3, summed_23)
    return unroll_size * (first + second)
