"""A GPT-style decoder in plain torch: RMSNorm, GQA attention with causal SDPA, SwiGLU MLP, untied head;
optionally a mixture of experts in place of the MLP (``experts > 0``: top-k routed SwiGLU experts and
an optional shared expert).

Small by default (the demo and tests trace it in well under a second), any size by config.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 1000
    hidden: int = 96
    heads: int = 6
    kv_heads: int = 2
    ffn: int = 256
    layers: int = 2
    experts: int = 0  # > 0: every layer's MLP is a mixture of this many experts
    top_k: int = 1
    expert_ffn: int = 64
    shared_ffn: int = 0  # > 0: plus a shared SwiGLU expert of this width
    dispatch: str = "batched"  # "batched" (dropless bmm), "grouped" (sorted tokens, _grouped_mm), "loop"
    capacity_factor: float = 0.0  # > 0 (grouped, loop): an expert keeps at most ceil(cf·tokens·top_k/experts) pairs

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, s, -1, cfg.head_dim).transpose(1, 2)  # -1: local heads under tensor parallelism
        k = self.k_proj(x).view(b, s, -1, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, cfg.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig, ffn: int | None = None) -> None:
        super().__init__()
        ffn = ffn or cfg.ffn
        self.gate_proj = nn.Linear(cfg.hidden, ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """``experts`` SwiGLU experts, dispatched three ways (``GPTConfig.dispatch``):

    - ``batched``: every (token, chosen expert) pair multiplied by its expert's weights with one
      batched matmul: dropless, each token visits exactly ``top_k`` experts;
    - ``grouped``: pairs sorted by expert and multiplied with ``torch._grouped_mm`` at offsets
      ``cumsum(kept per expert)``; with a capacity, an expert keeps its first ``capacity`` pairs (in
      token order) and the dropped pairs sort past the last offset, where no row is computed;
    - ``loop``: the same routing and capacity as ``grouped``, one matmul per expert on the rows it
      kept (the reference FlopCounterMode counts).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate_up = nn.Parameter(torch.randn(cfg.experts, cfg.hidden, 2 * cfg.expert_ffn) * 0.02)
        self.down = nn.Parameter(torch.randn(cfg.experts, cfg.expert_ffn, cfg.hidden) * 0.02)

    def forward(self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = chosen.shape[-1]
        if self.cfg.dispatch == "batched":
            out = self._batched(tokens.repeat_interleave(k, dim=0), chosen.reshape(-1))
        else:
            pairs, kept = tokens.repeat_interleave(k, dim=0), self._kept(chosen.reshape(-1))
            dispatch = self._grouped if self.cfg.dispatch == "grouped" else self._loop
            out = dispatch(pairs, chosen.reshape(-1), kept)
        return (out * weights.reshape(-1, 1)).reshape(-1, k, tokens.shape[-1]).sum(1)

    def _batched(self, pairs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        gate, up = torch.bmm(pairs.unsqueeze(1), self.gate_up[expert]).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down[expert]).squeeze(1)

    def _kept(self, expert: torch.Tensor) -> torch.Tensor:
        """Which (token, expert) pairs their expert keeps: all, or its first ``capacity`` in token order."""
        if not self.cfg.capacity_factor:
            return torch.ones_like(expert, dtype=torch.bool)
        factor = Fraction(self.cfg.capacity_factor).limit_denominator(1000)
        slots = factor.numerator * expert.shape[0]
        capacity = (slots + factor.denominator * self.cfg.experts - 1) // (factor.denominator * self.cfg.experts)
        onehot = F.one_hot(expert, self.cfg.experts)
        rank = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # position of the pair among its expert's pairs
        return rank < capacity

    def _grouped(self, pairs: torch.Tensor, expert: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(expert + self.cfg.experts * (~kept).long(), stable=True)  # dropped pairs last
        per_expert = (F.one_hot(expert, self.cfg.experts) * kept.unsqueeze(-1)).sum(0)
        offs = per_expert.cumsum(0).to(torch.int32)
        computed = (torch.arange(pairs.shape[0], device=pairs.device) < offs[-1]).unsqueeze(-1)
        hidden = torch.where(computed, torch._grouped_mm(pairs[order], self.gate_up, offs=offs), 0)
        gate, up = hidden.chunk(2, dim=-1)
        sorted_out = torch.where(computed, torch._grouped_mm(F.silu(gate) * up, self.down, offs=offs), 0)
        return torch.zeros_like(sorted_out).index_copy(0, order, sorted_out)

    def _loop(self, pairs: torch.Tensor, expert: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(pairs)
        for e in range(self.cfg.experts):
            rows = ((expert == e) & kept).nonzero().squeeze(-1)
            gate, up = (pairs[rows] @ self.gate_up[e]).chunk(2, dim=-1)
            out = out.index_copy(0, rows, (F.silu(gate) * up) @ self.down[e])
        return out


class MoE(nn.Module):
    """Router (softmax over experts, top-k), routed experts, optional shared expert."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)
        self.shared_expert = SwiGLU(cfg, cfg.shared_ffn) if cfg.shared_ffn else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        out = self.experts(tokens, chosen, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden)
        self.mlp = MoE(cfg) if cfg.experts else SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def forward_flops_formula(cfg: GPTConfig, batch: int, seq: int) -> int:
    """Hand formula of TinyGPT's forward FLOPs (FlopCounterMode convention, written from the math).

    Per token: 2 FLOPs per weight of every matmul (QKVO, SwiGLU, head): 2·N_matmul.
    Attention core per layer: QKᵀ and P·V at query heads over the full s×s (causal not halved):
    2·2·b·heads·s²·head_dim. Embedding, norms, softmax, SiLU: not counted.
    """
    hd = cfg.head_dim
    per_layer = cfg.hidden * hd * (2 * cfg.heads + 2 * cfg.kv_heads) + 3 * cfg.hidden * cfg.ffn
    n_matmul = cfg.layers * per_layer + cfg.hidden * cfg.vocab
    return 2 * n_matmul * batch * seq + 4 * cfg.layers * batch * cfg.heads * seq * seq * hd


def example(layers: int = 2) -> dict:
    """TinyGPT for ``fxflops report/check``: model, example inputs, dims and the Megatron formula
    (training FLOPs, to check with ``--backward --convention megatron``)."""
    from fxflops.formulas import gpt_training_flops

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=1024, layers=layers)

    def megatron(batch, seq):
        return gpt_training_flops(
            tokens=batch * seq, sum_seq_squared=batch * seq**2, layers=cfg.layers, hidden=cfg.hidden,
            ffn_hidden=cfg.ffn, heads=cfg.heads, query_groups=cfg.kv_heads, kv_channels=cfg.head_dim,
            vocab=cfg.vocab, glu=True,
        )

    return {
        "model": TinyGPT(cfg),
        "args": (torch.randint(0, cfg.vocab, (2, 64)),),
        "dims": {"input_ids": {0: "batch", 1: "seq"}},
        "formulas": {"megatron": megatron, "hand": lambda batch, seq: forward_flops_formula(cfg, batch, seq)},
    }
