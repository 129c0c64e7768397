"""FLOPs rules for packed variable-length attention (offsets ``cu_seqlens`` in the data).

Convention as the dense SDPA rules (FlopCounterMode): sequence i with sq_i queries and sk_i keys costs
2·Hq·sq_i·sk_i·(Dqk + Dv) forward and 2·Hq·sq_i·sk_i·(3·Dqk + 2·Dv) backward (2.5× for Dqk = Dv), GQA
at query heads, causal and sliding windows not discounted. Summed over the pieces that is
2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i, and for self-attention Σᵢ sq_i·sk_i = p₂ = Σᵢ sᵢ² of the offsets'
segment family (see ``fxflops/analysis/segments.py``). Layouts: ``(total, heads, head_dim)`` (flash-attn
varlen, torch's varlen_attn, fxflops.ops), optionally with a leading batch dim of 1 (xformers).
Source: torch/utils/flop_counter.py ``_unpack_flash_attention_nested_shapes`` (the same per-sequence
sum, which it reads with a host sync from ``cum_seq.tolist()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy

from fxflops.rules.registry import register

if TYPE_CHECKING:  # what the analysis passes for an offsets argument (fxflops/analysis/segments.py)
    from fxflops.analysis.segments import SegmentLengths


def pair_sum(a: SegmentLengths, b: SegmentLengths) -> sympy.Expr:
    """Σᵢ a_i·b_i for query and key offsets: p₂ when both are the same family (self-attention)."""
    if a.family is not b.family:
        raise ValueError(
            f"query offsets ({a.family.describe()}) and key offsets ({b.family.describe()}) are "
            "different families; fxflops counts varlen attention whose query and key segments coincide"
        )
    return a.power_sum(2)


def varlen_forward_flops(query, key, value, cu_q: SegmentLengths, cu_k: SegmentLengths | None):
    """2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i; ``cu_k=None`` means the keys are cut like the queries."""
    cu_k = cu_q if cu_k is None else cu_k
    cu_q.packed(query[-3])
    cu_k.packed(key[-3])
    return 2 * query[-2] * (query[-1] + value[-1]) * pair_sum(cu_q, cu_k)


def _causal_pairs(cu_q: SegmentLengths, cu_k: SegmentLengths | None):
    """Query-key pairs a causal mask keeps: Σᵢ sᵢ(sᵢ+1)/2 = (p₂ + p₁)/2 (self-attention only)."""
    cu_k = cu_q if cu_k is None else cu_k
    pair_sum(cu_q, cu_k)  # refuses different query and key families
    return (cu_q.power_sum(2) + cu_q.power_sum(1)) * sympy.Rational(1, 2)


def varlen_forward_causal(query, key, value, cu_q: SegmentLengths, cu_k: SegmentLengths | None):
    """Causal varlen forward, exactly: 2·Hq·(Dqk + Dv)·(p₂ + p₁)/2."""
    return 2 * query[-2] * (query[-1] + value[-1]) * _causal_pairs(cu_q, cu_k)


def varlen_backward_causal(query, key, value, cu_q: SegmentLengths, cu_k: SegmentLengths | None):
    """Causal varlen backward, exactly: 2·Hq·(3·Dqk + 2·Dv)·(p₂ + p₁)/2."""
    return 2 * query[-2] * (3 * query[-1] + 2 * value[-1]) * _causal_pairs(cu_q, cu_k)


def varlen_backward_flops(query, key, value, cu_q: SegmentLengths, cu_k: SegmentLengths | None):
    """2·Hq·(3·Dqk + 2·Dv)·Σᵢ sq_i·sk_i: recomputed QKᵀ, dP, dV, dQ, dK per segment."""
    cu_k = cu_q if cu_k is None else cu_k
    return 2 * query[-2] * (3 * query[-1] + 2 * value[-1]) * pair_sum(cu_q, cu_k)


def recomputed_scores(q_at: int):
    """The share of a fused attention backward (query at ``q_at``, key and value after it) that
    recomputes the forward's S = Q·Kᵀ: Dqk / (3·Dqk + 2·Dv) of 2·…·(3·Dqk + 2·Dv). FlashAttention-2
    (Dao, 2023) Algorithm 2, line 11; torch/utils/flop_counter.py ``sdpa_backward_flop_count`` step 1."""

    def share(*args, out_shape=None, **kwargs):
        qk_dim, v_dim = sympy.sympify(args[q_at][-1]), sympy.sympify(args[q_at + 2][-1])
        return qk_dim / (3 * qk_dim + 2 * v_dim)

    return share


def _api(flops_of, q_at: int, offsets_at: int, block_table_at: int | None):
    """A rule for a varlen API with q, k, v at ``q_at`` and the two offsets at ``offsets_at``; a paged
    KV cache (``block_table``, at ``block_table_at`` or by keyword) is refused: its work depends on a
    page table held in data."""

    def rule(*args, out_shape=None, **kwargs):
        positional = args[block_table_at] if block_table_at is not None and block_table_at < len(args) else None
        if kwargs.get("block_table") is not None or positional is not None:
            raise ValueError("paged varlen attention (block_table) costs what its page table says; fxflops does not count it")
        q, k, v = args[q_at : q_at + 3]
        return flops_of(q, k, v, args[offsets_at], args[offsets_at + 1])

    rule.__doc__ = f"{flops_of.__doc__} (q, k, v at {q_at}, offsets at {offsets_at})"
    return rule


def _register(name: str, backward: bool, q_at: int, offsets_at: int, block_table_at: int | None = None) -> None:
    """Register ``name`` (``"namespace::op"``) with its full and exact-causal rules. Sliding windows
    (``window_size``) are counted dense per segment, like causal masks under ``causal="full"``."""
    full, causal = (varlen_backward_flops, varlen_backward_causal) if backward else (varlen_forward_flops, varlen_forward_causal)
    recomputed = recomputed_scores(q_at) if backward else None
    register(
        name, segments=(offsets_at, offsets_at + 1), causal=_api(causal, q_at, offsets_at, block_table_at), recomputed=recomputed
    )(
        _api(full, q_at, offsets_at, block_table_at)
    )


# op name, backward?, position of q (k, v follow), position of cu_seqlens_q (cu_seqlens_k follows)
_register("fxflops::varlen_attention", False, 0, 3)  # fxflops.ops.varlen_attention
_register("fxflops::varlen_attention_backward", True, 1, 4)
_register("torch_attn::_varlen_attn", False, 0, 3, 12)  # torch.nn.attention.varlen.varlen_attn
_register("torch_attn::_varlen_attn_out", False, 1, 4, 13)  # varlen_attn_out writes into its first argument
_register("torch_attn::_varlen_attn_backward", True, 1, 6)
# flash-attn >= 2.6 registers flash_attn_varlen_func's ops with torch.library (flash_attn_interface.py:
# q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim), cu_seqlens int32 (batch + 1))
_register("flash_attn::_flash_attn_varlen_forward", False, 0, 3)
_register("flash_attn::_flash_attn_varlen_forward_v3", False, 0, 3)
_register("flash_attn::_flash_attn_varlen_backward", True, 1, 9)
