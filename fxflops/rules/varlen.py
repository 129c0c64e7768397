"""FLOPs rules for packed variable-length attention (offsets ``cu_seqlens`` in the data).

Convention as the dense SDPA rules (FlopCounterMode): sequence i with sq_i queries and sk_i keys costs
2·Hq·sq_i·sk_i·(Dqk + Dv) forward and 2·Hq·sq_i·sk_i·(3·Dqk + 2·Dv) backward (2.5× for Dqk = Dv), GQA
at query heads, causal and sliding windows not discounted. Summed over the pieces that is
2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i, and for self-attention Σᵢ sq_i·sk_i = p₂ = Σᵢ sᵢ² of the offsets'
segment family (see ``fxflops/capture/segments.py``). Layouts: ``(total, heads, head_dim)`` (flash-attn
varlen, torch's varlen_attn, fxflops.ops), optionally with a leading batch dim of 1 (xformers).
Source: torch/utils/flop_counter.py ``_unpack_flash_attention_nested_shapes`` (the same per-sequence
sum, which it reads with a host sync from ``cum_seq.tolist()``).
"""

from __future__ import annotations

from fxflops.capture.segments import SegmentLengths, pair_sum
from fxflops.rules.registry import register

def varlen_forward_flops(query, key, value, cu_q: SegmentLengths, cu_k: SegmentLengths | None):
    """2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i; ``cu_k=None`` means the keys are cut like the queries."""
    cu_k = cu_q if cu_k is None else cu_k
    cu_q.packed(query[-3])
    cu_k.packed(key[-3])
    return 2 * query[-2] * (query[-1] + value[-1]) * pair_sum(cu_q, cu_k)


def varlen_backward_flops(query, key, value, cu_q: SegmentLengths, cu_k: SegmentLengths | None):
    """2·Hq·(3·Dqk + 2·Dv)·Σᵢ sq_i·sk_i: recomputed QKᵀ, dP, dV, dQ, dK per segment."""
    cu_k = cu_q if cu_k is None else cu_k
    return 2 * query[-2] * (3 * query[-1] + 2 * value[-1]) * pair_sum(cu_q, cu_k)


@register("fxflops::varlen_attention", segments=(3, 4))
def fxflops_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, out_shape=None, **kwargs):
    """fxflops.ops.varlen_attention: 2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i."""
    return varlen_forward_flops(q, k, v, cu_seqlens_q, cu_seqlens_k)


@register("fxflops::varlen_attention_backward", segments=(4, 5))
def fxflops_varlen_attention_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, *args, out_shape=None, **kwargs):
    """Backward of fxflops.ops.varlen_attention: 2·Hq·(3·Dqk + 2·Dv)·Σᵢ sq_i·sk_i."""
    return varlen_backward_flops(q, k, v, cu_seqlens_q, cu_seqlens_k)


@register("torch_attn::_varlen_attn", segments=(3, 4))
def torch_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, *args, out_shape=None, **kwargs):
    """torch.nn.attention.varlen.varlen_attn forward: 2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i."""
    return varlen_forward_flops(query, key, value, cu_seq_q, cu_seq_k)


@register("torch_attn::_varlen_attn_out", segments=(4, 5))
def torch_varlen_attn_out(out, query, key, value, cu_seq_q, cu_seq_k, *args, out_shape=None, **kwargs):
    """torch.nn.attention.varlen.varlen_attn_out (writes into ``out``): as the forward."""
    return varlen_forward_flops(query, key, value, cu_seq_q, cu_seq_k)


@register("torch_attn::_varlen_attn_backward", segments=(6, 7))
def torch_varlen_attn_backward(grad_out, query, key, value, forward_out, lse, cu_seq_q, cu_seq_k, *args, out_shape=None, **kwargs):
    """torch.nn.attention.varlen backward: 2·Hq·(3·Dqk + 2·Dv)·Σᵢ sq_i·sk_i."""
    return varlen_backward_flops(query, key, value, cu_seq_q, cu_seq_k)


@register("flash_attn::_flash_attn_varlen_forward", "flash_attn::_flash_attn_varlen_forward_v3", segments=(3, 4))
def flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, out_shape=None, **kwargs):
    """flash_attn.flash_attn_varlen_func's op (flash-attn >= 2.6 registers it with torch.library).

    Source: flash-attn ``flash_attn_interface.py``: q (total_q, nheads, headdim), k/v (total_k,
    nheads_k, headdim), cu_seqlens int32 (batch + 1).
    """
    return varlen_forward_flops(q, k, v, cu_seqlens_q, cu_seqlens_k)


@register("flash_attn::_flash_attn_varlen_backward", segments=(9, 10))
def flash_attn_varlen_backward(dout, q, k, v, forward_out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *args, out_shape=None, **kwargs):
    """flash-attn varlen backward (dq, dk, dv written in place): 2·Hq·(3·Dqk + 2·Dv)·Σᵢ sq_i·sk_i."""
    return varlen_backward_flops(q, k, v, cu_seqlens_q, cu_seqlens_k)

