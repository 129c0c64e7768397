"""A Qwen2-VL-shaped vision-language model in plain torch, small enough to trace and run in tests.

* ``visual``: patch embedding (a Conv3d over ``(patches, C·T·P·P)`` pixel rows, kernel = stride), vision
  blocks with bidirectional attention **per frame** over the packed patches (offsets built inside the
  model from ``image_grid_thw`` with ``repeat_interleave``/``cumsum``/``pad``, as Qwen2-VL does), and a
  2×2 patch merger MLP.
* ``language_model``: a decoder with GQA, SwiGLU and **causal attention per packed text sequence**
  (THD layout, ``cu_seqlens``), the merged image tokens scattered into the text embeddings.
* ``lm_head``.

Inputs: ``input_ids (1, T)``, ``cu_seqlens (n+1,)`` (offsets of the packed sequences; tokens past
``cu_seqlens[-1]`` are padding, not attended), ``pixel_values (patches, C·T·P·P)``,
``image_grid_thw (N, 3)`` (t, h, w in patches per image or video; t frames of h·w patches each).

``attention="varlen"`` runs :func:`fxflops.ops.varlen_attention`; ``attention="loop"`` computes the same
attention as explicit per-segment matmuls (``.tolist()`` on the offsets), which FlopCounterMode can
count: the independent reference of the tests; ``attention="loop_sdpa"`` runs SDPA per segment (the
kernel the varlen op uses, with its fused backward). Rotary position embeddings are left out: they cost no
matmul FLOPs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxflops.ops import varlen_attention


@dataclass(frozen=True)
class VLMConfig:
    vocab: int = 512
    image_token_id: int = 511
    in_channels: int = 3
    temporal_patch: int = 2
    patch: int = 4
    merge: int = 2
    vision_hidden: int = 64
    vision_heads: int = 4
    vision_mlp: int = 160
    vision_layers: int = 2
    hidden: int = 96
    heads: int = 6
    kv_heads: int = 2
    ffn: int = 224
    layers: int = 2
    attention: str = "varlen"  # or "loop": per-segment matmuls, the reference for FlopCounterMode

    @property
    def pixel_dim(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch * self.patch


def packed_attention(q, k, v, cu_seqlens, causal: bool, impl: str) -> torch.Tensor:
    """Attention within each segment of packed (total, heads, dim) q/k/v (GQA by kv-head groups).

    ``impl="loop"`` splits the rows by ``lengths.tolist()`` as Hugging Face's vision attention does
    (the last chunk is the padding past ``cu_seqlens[-1]``, output zero) and runs explicit matmuls;
    ``impl="loop_sdpa"`` runs ``scaled_dot_product_attention`` on each chunk instead.
    """
    if impl == "varlen":
        return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal)
    if impl not in ("loop", "loop_sdpa"):
        raise ValueError(f"attention must be 'varlen', 'loop' or 'loop_sdpa', not {impl!r}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    padding = q.shape[0] - sum(lengths)
    sizes = [*lengths, padding]
    groups = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(*(torch.split(t, sizes)[:-1] for t in (q, k, v))):
        qs = qs.transpose(0, 1)  # (heads, s, dim)
        ks = ks.repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = vs.repeat_interleave(groups, dim=1).transpose(0, 1)
        if impl == "loop_sdpa":  # 4-d inputs: the fused CPU kernel, as the varlen op uses
            attended = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=causal)[0]
            outs.append(attended.transpose(0, 1))
            continue
        scores = torch.matmul(qs, ks.transpose(1, 2)) / qs.shape[-1] ** 0.5
        if causal:
            future = torch.ones(qs.shape[1], qs.shape[1], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        outs.append(torch.matmul(scores.softmax(-1), vs).transpose(0, 1))
    outs.append(q.new_zeros(padding, q.shape[1], v.shape[2]))
    return torch.cat(outs)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kernel = (cfg.temporal_patch, cfg.patch, cfg.patch)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.vision_hidden, kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        x = pixel_values.view(-1, c.in_channels, c.temporal_patch, c.patch, c.patch)
        return self.proj(x).view(-1, c.vision_hidden)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.vision_hidden, 3 * cfg.vision_hidden)
        self.proj = nn.Linear(cfg.vision_hidden, cfg.vision_hidden)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        q, k, v = self.qkv(x).view(-1, 3, c.vision_heads, c.vision_hidden // c.vision_heads).unbind(1)
        out = packed_attention(q, k, v, cu_seqlens, causal=False, impl=c.attention)
        return self.proj(out.reshape(-1, c.vision_hidden))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.vision_hidden)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.vision_hidden)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.vision_hidden, cfg.vision_mlp), nn.GELU(), nn.Linear(cfg.vision_mlp, cfg.vision_hidden)
        )

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenate each 2×2 group of neighbouring patches (adjacent rows) and project to the LM width."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        width = cfg.vision_hidden * cfg.merge**2
        self.width = width
        self.norm = nn.LayerNorm(cfg.vision_hidden)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x).view(-1, self.width))


class VisionTower(nn.Module):
    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_layers))
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        # one attention segment per temporal frame of h·w patches (Qwen2-VL's cu_seqlens)
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        cu_seqlens = F.pad(frames.cumsum(dim=0, dtype=torch.int32), (1, 0), value=0)
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return self.merger(x)


class TextAttention(nn.Module):
    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        head_dim = cfg.hidden // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * head_dim)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * head_dim)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * head_dim)
        self.o_proj = nn.Linear(cfg.heads * head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        head_dim = c.hidden // c.heads
        q = self.q_proj(x).view(-1, c.heads, head_dim)
        k = self.k_proj(x).view(-1, c.kv_heads, head_dim)
        v = self.v_proj(x).view(-1, c.kv_heads, head_dim)
        out = packed_attention(q, k, v, cu_seqlens, causal=True, impl=c.attention)
        return self.o_proj(out.reshape(-1, c.hidden))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(cfg.hidden)
        self.self_attn = TextAttention(cfg)
        self.post_attention_norm = nn.RMSNorm(cfg.hidden)
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x), cu_seqlens)
        h = self.post_attention_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LanguageModel(nn.Module):
    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)

    def forward(self, inputs_embeds: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return self.norm(x)


class TinyVLM(nn.Module):
    def __init__(self, cfg: VLMConfig = VLMConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = VisionTower(cfg)
        self.language_model = LanguageModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
    ) -> torch.Tensor:
        image_embeds = self.visual(pixel_values, image_grid_thw)
        embeds = self.language_model.embed_tokens(input_ids)
        is_image = (input_ids == self.cfg.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(is_image, image_embeds)
        hidden = self.language_model(embeds[0], cu_seqlens)
        return self.lm_head(hidden).unsqueeze(0)


@dataclass
class Batch:
    """One packed multimodal microbatch and the sizes it was built from."""

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    sequence_lengths: list[int]  # attended text sequences (image tokens included)
    padding: int  # tokens past cu_seqlens[-1]

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.cu_seqlens, self.pixel_values, self.image_grid_thw


def random_batch(
    cfg: VLMConfig,
    rng: random.Random,
    images: tuple[int, int] = (1, 8),
    frames: tuple[int, int] = (1, 3),
    side: tuple[int, int] = (1, 5),
    sequences: tuple[int, int] = (1, 32),
    text: tuple[int, int] = (1, 40),
    padding: int = 0,
) -> Batch:
    """A random microbatch: N images (t frames of h×w patches, h and w multiples of ``merge``), the
    merged image tokens placed in random packed text sequences, then ``padding`` unattended tokens."""
    grid = [
        (rng.randint(*frames), cfg.merge * rng.randint(*side), cfg.merge * rng.randint(*side))
        for _ in range(rng.randint(*images))
    ]
    seq_tokens = [[rng.randrange(cfg.image_token_id) for _ in range(rng.randint(*text))] for _ in range(rng.randint(*sequences))]
    for t, h, w in grid:
        chosen = seq_tokens[rng.randrange(len(seq_tokens))]
        at = rng.randint(0, len(chosen))
        chosen[at:at] = [cfg.image_token_id] * (t * h * w // cfg.merge**2)
    lengths = [len(s) for s in seq_tokens]
    ids = [tok for s in seq_tokens for tok in s] + [0] * padding
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    patches = sum(t * h * w for t, h, w in grid)
    return Batch(
        input_ids=torch.tensor([ids]),
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32),
        pixel_values=torch.randn(patches, cfg.pixel_dim),
        image_grid_thw=torch.tensor(grid),
        sequence_lengths=lengths,
        padding=padding,
    )


def forward_flops_formula(cfg: VLMConfig, tokens, patches, text_p2, frames_p2):
    """Hand formula of TinyVLM's forward FLOPs (FlopCounterMode convention), written from the math.

    Vision, per patch: patch embedding 2·(C·T·P·P)·Hv, and per block QKV 2·Hv·3Hv, projection 2·Hv²,
    MLP 2·2·Hv·I. Vision attention is per frame and bidirectional: QKᵀ and P·V, 2·2·Hv·s² per frame of
    s patches and per block, i.e. 4·Hv·Lv·Σ s² (``frames_p2``). Merger, per merged token
    (patches / merge²): 2·(W² + W·H) with W = merge²·Hv. Text, per token and layer: 2·H·(heads·d)
    for Q, 2·2·H·(kv_heads·d) for K and V, 2·(heads·d)·H for O, 3·2·H·F for SwiGLU; causal attention
    per packed sequence, not halved: 4·H·L·Σ s² (``text_p2``). LM head 2·H·V per token.
    Embedding, norms, softmax, activations, biases: not counted.
    """
    c = cfg
    head_dim = c.hidden // c.heads
    vision_per_patch = 2 * c.pixel_dim * c.vision_hidden + c.vision_layers * 2 * (
        4 * c.vision_hidden**2 + 2 * c.vision_hidden * c.vision_mlp
    )
    width = c.merge**2 * c.vision_hidden
    merged_tokens = patches // c.merge**2
    text_per_token = c.layers * 2 * (
        c.hidden * head_dim * (2 * c.heads + 2 * c.kv_heads) + 3 * c.hidden * c.ffn
    ) + 2 * c.hidden * c.vocab
    return (
        vision_per_patch * patches
        + 4 * c.vision_hidden * c.vision_layers * frames_p2
        + 2 * (width**2 + width * c.hidden) * merged_tokens
        + text_per_token * tokens
        + 4 * c.hidden * c.layers * text_p2
    )


def example(layers: int = 2) -> dict:
    """The example VLM for ``fxflops report/check``: model, example inputs, dims, segments, formulas."""
    torch.manual_seed(0)
    cfg = VLMConfig(vision_layers=layers, layers=layers)
    return {
        "model": TinyVLM(cfg),
        "args": random_batch(cfg, random.Random(0)).inputs(),
        "dims": {"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}},
        "segments": {"cu_seqlens": "text", "image_grid_thw": "frames"},
        "formulas": {
            "hand": lambda tokens, patches, text_p2, frames_p2: forward_flops_formula(cfg, tokens, patches, text_p2, frames_p2),
            "pack-length-squared": lambda tokens, patches, text_p2, frames_p2: forward_flops_formula(
                cfg, tokens, patches, tokens**2, frames_p2
            ),
        },
    }
