"""``fxflops.ops.varlen_attention``: packed variable-length attention as a ``torch.library`` custom op.

The layout is flash-attn's varlen API: ``q`` is ``(total_q, heads, head_dim)``, ``k`` and ``v`` are
``(total_k, kv_heads, head_dim)`` with ``heads % kv_heads == 0`` (grouped-query attention), and
``cu_seqlens_q``/``cu_seqlens_k`` are int32/int64 cumulative offsets ``[0, s₀, s₀+s₁, ...]`` of the
packed sequences. Sequence i attends only within itself (``causal=True`` adds the causal mask,
top-left aligned). Rows past ``cu_seqlens[-1]`` are padding: not attended, output zero.

Model authors get one opaque op that traces in one piece with symbolic shapes (the fake kernel needs
no data), and fxflops counts it as 2·Hq·(Dqk + Dv)·Σᵢ sq_i·sk_i from the segment power sums. The CPU
kernel loops over the segments (a reference implementation, not a fast one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """One segment: (s, H, D) inputs -> (s, H, Dv), GQA by repeating the kv heads. Inputs go to SDPA
    as (1, H, s, D), which selects the fused CPU kernel (its backward recomputes QKᵀ, as the FLOPs
    rule counts) rather than the math fallback taken for 3-d inputs."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)[0].transpose(0, 1)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    torch._check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, lambda: "q, k, v must be (total, heads, dim)")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "heads must be a multiple of kv_heads")


@torch.library.custom_op("fxflops::varlen_attention", mutates_args=())
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
) -> torch.Tensor:
    """Attention within each packed segment (see the module docstring)."""
    _check(q, k, v)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    for (q0, q1), (k0, k1) in zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k)):
        if q1 > q0 and k1 > k0:
            out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], causal)
    return out


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False):
    _check(q, k, v)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


def _attend_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one segment's attention, in closed form (no autograd or functorch inside the op,
    so it runs under any dispatch mode: FlopCounterMode, profilers). With S = Q·Kᵀ·c (c = 1/√D, causal
    entries -∞), P = softmax(S), O = P·V:

        dV = Pᵀ·dO,   dP = dO·Vᵀ,   dS = P ∘ (dP − rowsum(dO ∘ O)),   dQ = c·dS·K,   dK = c·dSᵀ·Q,

    per head; a key/value head shared by ``groups`` query heads (GQA) sums their dK, dV."""
    groups = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(groups, dim=1).transpose(0, 1), v.repeat_interleave(groups, dim=1).transpose(0, 1)
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    d_out = grad_out.transpose(0, 1)
    out = torch.matmul(probs, vh)
    d_v = torch.matmul(probs.transpose(1, 2), d_out)
    d_probs = torch.matmul(d_out, vh.transpose(1, 2))
    d_scores = probs * (d_probs - (d_out * out).sum(-1, keepdim=True))
    d_q = torch.matmul(d_scores, kh) * scale
    d_k = torch.matmul(d_scores.transpose(1, 2), qh) * scale

    def per_kv_head(grad: torch.Tensor) -> torch.Tensor:  # (H, s, D) -> (s, H_kv, D), summed over each group
        return grad.reshape(k.shape[1], groups, *grad.shape[1:]).sum(1).transpose(0, 1)

    return d_q.transpose(0, 1), per_kv_head(d_k), per_kv_head(d_v)


@torch.library.custom_op("fxflops::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`varlen_attention` w.r.t. q, k, v (per segment, :func:`_attend_backward`)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k)):
        if q1 > q0 and k1 > k0:
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = _attend_backward(grad_out[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], causal)
    return dq, dk, dv


@varlen_attention_backward.register_fake
def _(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, causal = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.causal = causal


def _backward(ctx, grad_out):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = varlen_attention_backward(grad_out, q, k, v, cu_q, cu_k, ctx.causal)
    return dq, dk, dv, None, None, None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)
