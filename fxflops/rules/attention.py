"""FLOPs rules for fused attention: SDPA aten forms, raw flash/efficient kernels, flex attention.

Conventions, as FlopCounterMode (torch/utils/flop_counter.py ``sdpa_flop_count`` and
``sdpa_backward_flop_count``), with one multiply-add = 2 FLOPs and ``B`` batch, ``Hq`` query heads,
``Sq``/``Sk`` query/key lengths, ``Dqk`` query/key head dim, ``Dv`` value head dim:

- forward: S = Q·Kᵀ and O = P·V -> 2·B·Hq·Sq·Sk·(Dqk + Dv) (= 4·B·H·S²·D for equal sizes);
- fused backward: recompute S = Q·Kᵀ, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q
  -> 2·B·Hq·Sq·Sk·(3·Dqk + 2·Dv) (= 2.5× forward for Dqk = Dv). The recomputed Q·Kᵀ,
  2·B·Hq·Sq·Sk·Dqk, is billed to the ``recompute`` phase: model FLOPs (fwd + bwd) then equal those
  of the same attention written as matmuls (2× forward), and hardware FLOPs keep the recompute;
- grouped-query attention is counted at the query heads (each query head does its own products);
- causal masks, attention masks/biases, dropout, softmax and block sparsity are not counted: the
  count is the dense one (causal is never halved); gradient masks are ignored (kernels compute all).

Several backward schemas name an input ``out`` (the forward output handed to the kernel); the rules
call it ``forward_out`` to keep it apart from the result shape ``out_shape``.
"""

from __future__ import annotations

import sympy
import torch

from fxflops.rules.registry import register
from fxflops.rules.varlen import (
    recomputed_scores,
    varlen_backward_causal,
    varlen_backward_flops,
    varlen_forward_causal,
    varlen_forward_flops,
)

aten = torch.ops.aten


def _attention_forward_flops(batch, q_heads, q_len, kv_len, qk_dim, v_dim):
    """2·B·Hq·Sq·Sk·(Dqk + Dv): Q·Kᵀ (2·Sq·Sk·Dqk) plus P·V (2·Sq·Sk·Dv) per batch and query head."""
    return 2 * batch * q_heads * q_len * kv_len * (qk_dim + v_dim)


def _attention_backward_flops(batch, q_heads, q_len, kv_len, qk_dim, v_dim):
    """2·B·Hq·Sq·Sk·(3·Dqk + 2·Dv): recomputed Q·Kᵀ, dP, dV, dQ, dK (Dqk, Dv, Dv, Dqk, Dqk)."""
    return 2 * batch * q_heads * q_len * kv_len * (3 * qk_dim + 2 * v_dim)


def _heads_first(flops, query, key, value):
    """Apply ``flops`` to (B, H, S, D) query/key/value shapes."""
    batch, q_heads, q_len, qk_dim = query
    return flops(batch, q_heads, q_len, key[2], qk_dim, value[3])


def _sequence_first(flops, query, key, value):
    """Apply ``flops`` to (B, S, H, D) query/key/value shapes (the raw flash/efficient layout)."""
    batch, q_len, q_heads, qk_dim = query
    return flops(batch, q_heads, q_len, key[1], qk_dim, value[3])


def _causal_pairs(q_len, kv_len):
    """Query-key pairs a causal mask keeps in square attention: s(s+1)/2 (``None`` if not square,
    where the mask's alignment decides)."""
    if sympy.sympify(q_len - kv_len) != 0:
        return None
    return q_len * (q_len + 1) * sympy.Rational(1, 2)


def _heads_first_causal(flops, query, key, value):
    """Exact causal ``flops`` for (B, H, S, D) shapes: the same cost per pair over s(s+1)/2 pairs."""
    pairs = _causal_pairs(query[2], key[2])
    return None if pairs is None else flops(query[0], query[1], 1, pairs, query[3], value[3])


def _sequence_first_causal(flops, query, key, value):
    """Exact causal ``flops`` for (B, S, H, D) shapes."""
    pairs = _causal_pairs(query[1], key[1])
    return None if pairs is None else flops(query[0], query[2], 1, pairs, query[3], value[3])


def sdpa_forward_causal(query, key, value, *args, out_shape=None, **kwargs):
    """Causal SDPA forward, exactly: 2·B·Hq·(Dqk + Dv)·s(s+1)/2."""
    return _heads_first_causal(_attention_forward_flops, query, key, value)


def sdpa_backward_causal(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    """Causal SDPA backward, exactly: 2·B·Hq·(3·Dqk + 2·Dv)·s(s+1)/2."""
    return _heads_first_causal(_attention_backward_flops, query, key, value)


def flash_attention_forward_causal(query, key, value, cum_seq_q, cum_seq_k, *args, out_shape=None, **kwargs):
    """Causal raw flash forward, exactly (dense (B,S,H,D) or packed varlen)."""
    if cum_seq_q is not None:
        return varlen_forward_causal(query, key, value, cum_seq_q, cum_seq_k)
    return _sequence_first_causal(_attention_forward_flops, query, key, value)


def flash_attention_backward_causal(grad_out, query, key, value, forward_out, logsumexp, cum_seq_q, cum_seq_k, *args, out_shape=None, **kwargs):
    """Causal raw flash backward, exactly."""
    if cum_seq_q is not None:
        return varlen_backward_causal(query, key, value, cum_seq_q, cum_seq_k)
    return _sequence_first_causal(_attention_backward_flops, query, key, value)


def efficient_attention_forward_causal(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, *args, out_shape=None, **kwargs):
    """Causal raw memory-efficient forward, exactly."""
    if cu_seqlens_q is not None:
        return varlen_forward_causal(query, key, value, cu_seqlens_q, cu_seqlens_k)
    return _sequence_first_causal(_attention_forward_flops, query, key, value)


def efficient_attention_backward_causal(grad_out_, query, key, value, bias, forward_out, cu_seqlens_q, cu_seqlens_k, *args, out_shape=None, **kwargs):
    """Causal raw memory-efficient backward, exactly."""
    if cu_seqlens_q is not None:
        return varlen_backward_causal(query, key, value, cu_seqlens_q, cu_seqlens_k)
    return _sequence_first_causal(_attention_backward_flops, query, key, value)


def _reject_paged(op_name, block_table):
    """Raise ``ValueError`` for a paged KV cache: its work depends on a page table held in data."""
    if block_table is not None:
        raise ValueError(
            f"{op_name}: paged attention (block_table) costs what its page table's data says, which "
            "tensor shapes do not carry; fxflops does not count it"
        )


@register(
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_fused_attention_overrideable,
    causal=sdpa_forward_causal,
)
def sdpa_forward(query, key, value, *args, out_shape=None, **kwargs):
    """SDPA kernels, (B,H,S,D) inputs: 2·B·Hq·Sq·Sk·(Dqk + Dv).

    Source: torch/utils/flop_counter.py ``sdpa_flop``, which does not register (so counts 0 for) the
    CPU flash kernel and the overrideable one.
    """
    return _heads_first(_attention_forward_flops, query, key, value)


@register(
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_fused_attention_overrideable_backward,
    causal=sdpa_backward_causal,
    recomputed=recomputed_scores(1),
)
def sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    """SDPA fused backward, (B,H,S,D) inputs: 2·B·Hq·Sq·Sk·(3·Dqk + 2·Dv).

    Source: torch/utils/flop_counter.py ``sdpa_backward_flop_count``; FlashAttention-2 paper
    (Dao, 2023) Algorithm 2 (backward recomputes S = Q·Kᵀ, then dV, dP, dQ, dK).
    """
    return _heads_first(_attention_backward_flops, query, key, value)


@register(aten._scaled_dot_product_efficient_attention_backward, causal=sdpa_backward_causal, recomputed=recomputed_scores(1))
def sdpa_efficient_backward(grad_out_, query, key, value, *args, out_shape=None, **kwargs):
    """Memory-efficient SDPA backward: as ``sdpa_backward`` (its schema names the gradient ``grad_out_``)."""
    return _heads_first(_attention_backward_flops, query, key, value)


@register(aten._flash_attention_forward, segments=(3, 4), causal=flash_attention_forward_causal)
def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, *args, out_shape=None, **kwargs):
    """Raw flash forward: dense (B,S,H,D) inputs 2·B·Hq·Sq·Sk·(Dqk + Dv); packed varlen inputs
    ((total, H, D) with offsets ``cum_seq_q``/``cum_seq_k``) 2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i.

    A paged KV cache (``block_table``) raises ``ValueError``: its work depends on a page table that
    shapes do not carry. ``seqused_k`` is not read (Sk is then an upper bound). Source:
    torch/utils/flop_counter.py ``_flash_attention_forward_flop``, which reads dense (B,S,H,D) inputs
    as (B,H,S,D); flash-attention ``flash_attn_func`` docs give the (batch, seqlen, nheads, headdim)
    layout.
    """
    _reject_paged("_flash_attention_forward", kwargs.get("block_table"))
    if cum_seq_q is not None:
        return varlen_forward_flops(query, key, value, cum_seq_q, cum_seq_k)
    return _sequence_first(_attention_forward_flops, query, key, value)


@register(aten._flash_attention_backward, segments=(6, 7), causal=flash_attention_backward_causal, recomputed=recomputed_scores(1))
def flash_attention_backward(
    grad_out, query, key, value, forward_out, logsumexp, cum_seq_q, cum_seq_k, *args, out_shape=None, **kwargs,
):
    """Raw flash backward: dense (B,S,H,D) 2·B·Hq·Sq·Sk·(3·Dqk + 2·Dv); varlen 2·Hq·(3·Dqk + 2·Dv)·Σ sq·sk.

    Source: torch/utils/flop_counter.py ``_flash_attention_backward_flop`` (same (B,S,H,D) misreading).
    """
    if cum_seq_q is not None:
        return varlen_backward_flops(query, key, value, cum_seq_q, cum_seq_k)
    return _sequence_first(_attention_backward_flops, query, key, value)


@register(aten._efficient_attention_forward, segments=(4, 5), causal=efficient_attention_forward_causal)
def efficient_attention_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, *args, out_shape=None, **kwargs):
    """Raw memory-efficient forward: dense (B,S,H,D) 2·B·Hq·Sq·Sk·(Dqk + Dv); packed varlen inputs
    ((1, total, H, D) with ``cu_seqlens_q``/``cu_seqlens_k``) 2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i.

    ``seqlen_k`` is not read (Sk is then an upper bound). Source: torch/utils/flop_counter.py
    ``_efficient_attention_forward_flop`` (reads (B,S,H,D) as (B,H,S,D)); xformers
    ``memory_efficient_attention`` docs give the [B, M, H, K] layout.
    """
    if cu_seqlens_q is not None:
        return varlen_forward_flops(query, key, value, cu_seqlens_q, cu_seqlens_k)
    return _sequence_first(_attention_forward_flops, query, key, value)


@register(
    aten._efficient_attention_backward, segments=(6, 7), causal=efficient_attention_backward_causal, recomputed=recomputed_scores(1)
)
def efficient_attention_backward(
    grad_out_, query, key, value, bias, forward_out, cu_seqlens_q, cu_seqlens_k, *args, out_shape=None, **kwargs,
):
    """Raw memory-efficient backward: dense 2·B·Hq·Sq·Sk·(3·Dqk + 2·Dv); varlen 2·Hq·(3·Dqk + 2·Dv)·Σ sq·sk.

    Source: torch/utils/flop_counter.py ``_efficient_attention_backward_flop``.
    """
    if cu_seqlens_q is not None:
        return varlen_backward_flops(query, key, value, cu_seqlens_q, cu_seqlens_k)
    return _sequence_first(_attention_backward_flops, query, key, value)


@register(torch.ops.higher_order.flex_attention)
def flex_attention(query, key, value, score_mod, block_mask, *args, out_shape=None, **kwargs):
    """flex_attention, (B,H,S,D) inputs: 2·B·Hq·Sq·Sk·(Dqk + Dv), dense.

    ``score_mod`` and the block mask are not read: block sparsity is data, so this is the dense
    count (FlopCounterMode scales by an optional ``sparsity_hint`` node annotation instead).
    Source: torch/utils/flop_counter.py ``flex_attention_forward_flop``.
    """
    return _heads_first(_attention_forward_flops, query, key, value)


@register(torch.ops.higher_order.flex_attention_backward, recomputed=recomputed_scores(0))
def flex_attention_backward(query, key, value, forward_out, logsumexp, grad_out, *args, out_shape=None, **kwargs):
    """flex_attention_backward, (B,H,S,D) inputs: 2·B·Hq·Sq·Sk·(3·Dqk + 2·Dv), dense.

    Source: torch/utils/flop_counter.py ``flex_attention_backward_flop``.
    """
    return _heads_first(_attention_backward_flops, query, key, value)
