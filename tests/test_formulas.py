"""The field's hand formulas (``fxflops.formulas``) against independent computations.

Expected numbers come from: parameter counts of real (tiny or meta-device) torch models, the FORMULAS.md
"Python-ish sketch" transcribed here, per-frame brute-force GEMM sums, and hand arithmetic. Nothing here
calls the library to produce an expected value.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import sympy
import torch
from torch import nn

from fxflops.formulas import (
    gpt_training_flops,
    hf_floating_point_ops,
    moe_layer_pattern,
    non_embedding_params,
    padded_vocab,
    palm_flops_per_iter,
    palm_flops_per_token,
    params_excluding,
    torchtitan_flops_per_token,
    torchtitan_moe_active_params,
    vision_patch_stats,
    vit_training_flops,
    vit_training_flops_legacy,
)

# ----------------------------------------------------------------------------------------- helpers


class _Block(nn.Module):
    """One decoder layer's GEMM weights (bias=False): q, k, v, o, [gate], up, down."""

    def __init__(self, h, n, g, kv, ffn, glu):
        super().__init__()
        self.q = nn.Linear(h, n * kv, bias=False)
        self.k = nn.Linear(h, g * kv, bias=False)
        self.v = nn.Linear(h, g * kv, bias=False)
        self.o = nn.Linear(n * kv, h, bias=False)
        self.gate = nn.Linear(h, ffn, bias=False) if glu else None
        self.up = nn.Linear(h, ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)
        self.norm = nn.LayerNorm(h)  # not a matmul, excluded from N_matmul by construction below


class _TinyGPT(nn.Module):
    def __init__(self, L, h, n, g, kv, ffn, glu, v, v_pad):
        super().__init__()
        self.embed = nn.Embedding(v, h)
        self.layers = nn.ModuleList(_Block(h, n, g, kv, ffn, glu) for _ in range(L))
        self.lm_head = nn.Linear(h, v_pad, bias=False)  # untied, padded vocab


def _linear_weight_numel(model):
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def bridge_dense(B, S, L, h, ffn, n, g, kv, V, glu, m=0, T=None, Q2=None):
    """FORMULAS.md §2.2 "Python-ish sketch", transcribed; only `/` made exact with Fraction."""
    T = T if T is not None else B * S
    c = Fraction(Q2, T) if Q2 is not None else Fraction(T, B)
    q, f = kv * n, (3 if glu else 2)
    proj = h * (q + 2 * kv * g) + q * h
    per_tok = (6 * h * f * ffn * (L + m) + 6 * (L + m) * (proj + q * c) + 6 * m * (3 * h + 2 * h * h)
               + 6 * h * V * (m + 1))
    return T * per_tok


# ----------------------------------------------------------------------------------------- Megatron GPT


def test_padded_vocab():
    assert padded_vocab(50257) == 50304
    assert padded_vocab(50257, 128, 8) == 51200  # ceil(50257/1024)·1024
    assert padded_vocab(1024, 128, 1) == 1024
    assert padded_vocab(1100, 128, 2) == 1280
    assert padded_vocab(1100, 1, 1) == 1100
    v = sympy.Symbol("V")
    assert padded_vocab(v, 1, 1) == v
    with pytest.raises(TypeError):
        padded_vocab(v, 128, 1)


@pytest.mark.parametrize("g, glu, tp, vocab", [(2, True, 1, 1000), (4, False, 2, 1100), (1, True, 4, 777)])
def test_dense_equals_six_n_matmul_plus_causal_core(g, glu, tp, vocab):
    L, h, n, kv, ffn = 3, 64, 4, 24, 96  # kv·n = 96 != h on purpose
    lengths = [5, 7, 20, 1]
    T, Q2 = sum(lengths), sum(s * s for s in lengths)
    v_pad = -(-vocab // (128 * tp)) * (128 * tp)
    model = _TinyGPT(L, h, n, g, kv, ffn, glu, vocab, v_pad)
    n_matmul = _linear_weight_numel(model)
    assert non_embedding_params(model) == n_matmul + L * 2 * h  # plus the LayerNorm affine params
    expected = 6 * n_matmul * T + 6 * L * (n * kv) * Q2
    got = gpt_training_flops(tokens=T, sum_seq_squared=Q2, layers=L, hidden=h, ffn_hidden=ffn, heads=n,
                             query_groups=g, kv_channels=kv, vocab=vocab, glu=glu, tensor_parallel=tp)
    assert got == expected and isinstance(got, int)


@pytest.mark.parametrize(
    "cfg",
    [
        # GQA
        {"B": 2, "S": 128, "L": 4, "h": 256, "ffn": 688, "n": 8, "g": 2, "kv": 32, "V": 32000, "glu": True},
        # MHA, no GLU
        {"B": 3, "S": 64, "L": 2, "h": 128, "ffn": 512, "n": 4, "g": 4, "kv": 32, "V": 1024, "glu": False},
        # MTP depth 1
        {"B": 1, "S": 256, "L": 6, "h": 192, "ffn": 512, "n": 6, "g": 6, "kv": 32, "V": 50304, "glu": True, "m": 1},
        # packed THD: T tokens in sub-sequences 40, 50, 6 (MQA)
        {"B": 1, "S": 96, "L": 2, "h": 64, "ffn": 160, "n": 4, "g": 1, "kv": 16, "V": 2048, "glu": True,
         "T": 96, "Q2": 40**2 + 50**2 + 6**2},
        # packed, MTP depth 2, no GLU
        {"B": 2, "S": 100, "L": 3, "h": 96, "ffn": 256, "n": 3, "g": 3, "kv": 48, "V": 4096, "glu": False, "m": 2,
         "T": 200, "Q2": 7 * 7 + 193 ** 2},
    ],
)
def test_matches_formulas_md_sketch(cfg):
    expected = bridge_dense(**cfg)
    T = cfg.get("T") or cfg["B"] * cfg["S"]
    Q2 = cfg.get("Q2") or cfg["B"] * cfg["S"] ** 2
    got = gpt_training_flops(tokens=T, sum_seq_squared=Q2, layers=cfg["L"], hidden=cfg["h"], ffn_hidden=cfg["ffn"],
                             heads=cfg["n"], query_groups=cfg["g"], kv_channels=cfg["kv"], vocab=cfg["V"],
                             glu=cfg["glu"], mtp_layers=cfg.get("m", 0))
    assert got == expected


def test_defaults_kv_channels_and_groups():
    common = {"tokens": 64, "sum_seq_squared": 2 * 32**2, "layers": 2, "hidden": 128, "ffn_hidden": 256,
              "heads": 8, "vocab": 512}
    assert gpt_training_flops(**common) == gpt_training_flops(**common, query_groups=8, kv_channels=16)


def test_symbolic_tokens_and_seq_squared():
    T, Q2 = sympy.symbols("T Q2", positive=True)
    L, h, n, g, kv, ffn, V, m = 4, 256, 8, 2, 32, 688, 32000, 1
    cfg = {"layers": L, "hidden": h, "ffn_hidden": ffn, "heads": n, "query_groups": g, "kv_channels": kv,
           "vocab": V, "mtp_layers": m}
    expr = sympy.expand(gpt_training_flops(tokens=T, sum_seq_squared=Q2, **cfg))
    poly = sympy.Poly(expr, T, Q2)
    assert poly.total_degree() == 1 and poly.coeff_monomial(1) == 0
    # causal core: 3 (fwd+bwd) · 2 (QKᵀ, PV) · 2 (FMA) · q · s²/2 = 6·q·s² per attention layer (L' = L + m)
    assert poly.coeff_monomial(Q2) == 6 * (L + m) * kv * n
    assert poly.coeff_monomial(Q2) * 2 == 12 * (L + m) * n * kv  # half of PaLM/torchtitan's 12·L·n·d
    for t, q2 in [(512, 2 * 256**2), (1000, 10**2 + 990**2)]:
        assert expr.subs({T: t, Q2: q2}) == gpt_training_flops(tokens=t, sum_seq_squared=q2, **cfg)


def test_fully_symbolic_model_dims():
    T, Q2, L, h, n, f = sympy.symbols("T Q2 L h n ffn", positive=True)
    expr = gpt_training_flops(tokens=T, sum_seq_squared=Q2, layers=L, hidden=h, ffn_hidden=f, heads=n,
                              vocab=sympy.Symbol("V"), make_vocab_size_divisible_by=1)
    # kv = h/n, q = h, g = n: proj = h·(h + 2h) + h² = 4h²; MLP 3·h·ffn; logits h·V
    V = sympy.Symbol("V")
    expected = T * (6 * h * 3 * f * L + 6 * L * 4 * h**2 + 6 * h * V) + 6 * L * h * Q2
    assert sympy.simplify(expr - expected) == 0
    assert not expr.atoms(sympy.Float)


def test_fraction_inputs_stay_exact():
    got = gpt_training_flops(tokens=Fraction(1, 7), sum_seq_squared=Fraction(1, 5), layers=1, hidden=8,
                             ffn_hidden=16, heads=2, vocab=128)
    assert isinstance(got, Fraction)
    per_token = 6 * 8 * 3 * 16 + 6 * (8 * (8 + 2 * 4 * 2) + 8 * 8) + 6 * 8 * 128
    assert got == Fraction(1, 7) * per_token + 6 * 8 * Fraction(1, 5)
    with pytest.raises(TypeError):
        gpt_training_flops(tokens=1.5, sum_seq_squared=1, layers=1, hidden=8, ffn_hidden=16, heads=2, vocab=128)


def test_moe_routed_shared_no_router():
    # 4 layers, moe_layer_freq=2 -> layers 0 and 2 are MoE. h=8, n=2 (kv=4, q=8), dense ffn 16, expert ffn 4,
    # top-2 of 6 experts, shared expert ffn 6, SwiGLU, vocab 100 -> 128.
    pattern = moe_layer_pattern(layers=4, moe_layer_freq=2)
    assert pattern == [1, 0, 1, 0]
    h, T, Q2 = 8, 10, 100
    dense_macs = 3 * h * 16  # gate, up, down
    moe_macs = 2 * (3 * h * 4) + 3 * h * 6  # top-2 routed experts + shared; the h×6 router is not counted
    attn_macs = h * 8 + 2 * (h * 4 * 2) + 8 * h  # q, k, v (g = n = 2 groups of kv 4), o
    per_token = 6 * (2 * dense_macs + 2 * moe_macs + 4 * attn_macs + h * 128)
    expected = T * per_token + 6 * 4 * 8 * Q2
    got = gpt_training_flops(tokens=T, sum_seq_squared=Q2, layers=4, hidden=h, ffn_hidden=16, heads=2, vocab=100,
                             moe_layers=sum(pattern), moe_ffn_hidden=4, moe_topk=2, shared_expert_ffn_hidden=6)
    assert got == expected

    # a real MoE layer's weights: activated matmul params per token = non-router params with experts at topk
    experts = nn.ModuleList(nn.ModuleList([nn.Linear(h, 4, bias=False), nn.Linear(h, 4, bias=False),
                                           nn.Linear(4, h, bias=False)]) for _ in range(6))
    router = nn.Linear(h, 6, bias=False)
    one_expert = sum(p.numel() for p in experts[0].parameters())
    assert moe_macs == 2 * one_expert + 3 * h * 6
    assert router.weight.numel() == 48  # would add 6·48 per token per MoE layer if it were counted

    # MTP takes the type of the last decoder layer: here dense (pattern[-1] == 0)
    with_mtp = gpt_training_flops(tokens=T, sum_seq_squared=Q2, layers=4, hidden=h, ffn_hidden=16, heads=2,
                                  vocab=100, moe_layers=2, moe_ffn_hidden=4, moe_topk=2, shared_expert_ffn_hidden=6,
                                  mtp_layers=1, mtp_moe=bool(pattern[-1]))
    mtp_per_token = 6 * (dense_macs + attn_macs + 3 * h + 2 * h * h + h * 128)
    assert with_mtp - got == T * mtp_per_token + 6 * 1 * 8 * Q2
    with pytest.raises(ValueError):  # ambiguous without mtp_moe
        gpt_training_flops(tokens=T, sum_seq_squared=Q2, layers=4, hidden=h, ffn_hidden=16, heads=2, vocab=100,
                           moe_layers=2, mtp_layers=1)


def test_moe_all_layers_and_latent():
    common = {"tokens": 4, "sum_seq_squared": 16, "layers": 2, "hidden": 16, "ffn_hidden": 32, "heads": 4, "vocab": 128,
                  "moe_layers": 2, "moe_ffn_hidden": 8, "moe_topk": 3, "glu": False}
    base = gpt_training_flops(**common)
    # all layers MoE -> the MTP layer is MoE too (inferred)
    mtp = gpt_training_flops(**common, mtp_layers=1)
    routed_macs = 3 * 2 * 16 * 8
    attn_macs = 4 * 16 * 16
    assert mtp - base == 4 * 6 * (routed_macs + attn_macs + 3 * 16 + 2 * 16 * 16 + 16 * 128) + 6 * 16 * 16
    # latent d=4: experts work in d, plus the h→d and d→h projections: R·h = ffn·topk·f·d + 2·d·h
    latent = gpt_training_flops(**common, moe_latent_size=4)
    assert base - latent == 4 * 6 * 2 * (routed_macs - (8 * 3 * 2 * 4 + 2 * 4 * 16))


def test_attention_output_gate():
    common = {"tokens": 8, "sum_seq_squared": 64, "layers": 3, "hidden": 32, "ffn_hidden": 64, "heads": 4,
              "kv_channels": 16, "vocab": 256}
    assert (gpt_training_flops(**common, attention_output_gate=True) - gpt_training_flops(**common)
            == 8 * 6 * 3 * 32 * (4 * 16))


# ----------------------------------------------------------------------------------------- ViT


def _vit_brute_force(rows, D, H, I, mu, H_out, deepstack):
    """Sum 2·m·n·k over every GEMM, frame by frame, ×3 for training."""
    gemms = []  # (m, n, k)
    merged_total = 0
    for t, hh, ww in rows:
        for _frame in range(t):
            P = hh * ww
            for _layer in range(D):
                gemms += [(P, H, H)] * 4  # q, k, v, o
                gemms += [(P, H, I), (P, I, H)]  # fc1, fc2 (no gate)
                gemms += [(P, H, P), (P, P, H)]  # QKᵀ over all heads (sum of head dims = H), then P·V
        merged_total += t * hh * ww // (mu * mu)
    for _merger in range(1 + deepstack):
        gemms += [(merged_total, mu * mu * H, mu * mu * H), (merged_total, mu * mu * H, H_out)]
    return 3 * sum(2 * m * n * k for m, n, k in gemms)


def test_vision_patch_stats():
    rows = [(1, 8, 12), (2, 4, 4), (1, 6, 6), (3, 2, 2)]
    assert vision_patch_stats(rows) == (96 + 32 + 36 + 12, 96**2 + 2 * 16**2 + 36**2 + 3 * 4**2, 24 + 8 + 9 + 3)
    assert vision_patch_stats(torch.tensor(rows)) == vision_patch_stats(rows)
    assert vision_patch_stats([(1, 3, 3)], spatial_merge_size=2) == (9, 81, 2)  # floor(9/4)
    assert vision_patch_stats([]) == (0, 0, 0)


@pytest.mark.parametrize("deepstack", [0, 3])
def test_vit_exact_matches_per_frame_brute_force(deepstack):
    rows = [(1, 8, 12), (2, 4, 4), (1, 6, 6), (3, 2, 2)]
    D, H, I, mu, H_out = 3, 16, 40, 2, 24
    sp, sp2, spm = vision_patch_stats(rows, spatial_merge_size=mu)
    got = vit_training_flops(sum_patches=sp, sum_patches_squared=sp2, sum_merged_patches=spm, depth=D, hidden=H,
                             intermediate=I, spatial_merge_size=mu, out_hidden=H_out, deepstack_layers=deepstack)
    assert got == _vit_brute_force(rows, D, H, I, mu, H_out, deepstack)


def test_vit_symbolic():
    sp, sp2, spm = sympy.symbols("P P2 Pm", positive=True)
    expr = sympy.expand(vit_training_flops(sum_patches=sp, sum_patches_squared=sp2, sum_merged_patches=spm, depth=2,
                                           hidden=8, intermediate=16, out_hidden=12))
    assert sympy.Poly(expr, sp, sp2, spm).as_dict() == {
        (1, 0, 0): 3 * 2 * (8 * 64 + 4 * 8 * 16),
        (0, 1, 0): 3 * 2 * 4 * 8,  # bidirectional: not halved
        (0, 0, 1): 3 * (2 * 32**2 + 2 * 32 * 12),
    }


def test_vit_legacy_vs_exact():
    dims = {"depth": 2, "hidden": 16, "intermediate": 32, "spatial_merge_size": 2, "out_hidden": 24}

    def exact(rows):
        sp, sp2, spm = vision_patch_stats(rows)
        return vit_training_flops(sum_patches=sp, sum_patches_squared=sp2, sum_merged_patches=spm, **dims)

    # one equal-sized image per sample: identical
    same = [(1, 16, 16), (1, 16, 16)]
    assert vit_training_flops_legacy(num_vision_patches=512, batch=2, **dims) == exact(same)

    # mixed sizes, one image per sample: legacy ΣP² = 2·160² = 51200 vs exact 64² + 256² = 69632
    mixed = [(1, 8, 8), (1, 16, 16)]
    diff = exact(mixed) - vit_training_flops_legacy(num_vision_patches=320, batch=2, **dims)
    assert diff == 3 * 2 * 4 * 16 * (69632 - 51200)

    # mixed sizes where the merged-patch floor differs too: P̄ = 14 -> 2·floor(14/4) = 6 vs exact 4 + 3 = 7
    rows = [(1, 4, 4), (1, 2, 6)]
    merger = 2 * 64**2 + 2 * 64 * 24
    diff = exact(rows) - vit_training_flops_legacy(num_vision_patches=28, batch=2, **dims)
    assert diff == 3 * (2 * 4 * 16 * (16**2 + 12**2 - 2 * 14**2) + (7 - 6) * merger)

    # two images in one sample: legacy sees one sequence of 512 patches
    assert vit_training_flops_legacy(num_vision_patches=512, batch=1, **dims) - exact(same) == (
        3 * 2 * 4 * 16 * (512**2 - 2 * 256**2))

    # a non-integer P̄ stays exact: P̄ = 3/5, ΣP² = 5·(3/5)² = 9/5, ΣP_m = 5·floor(3/20) = 0
    legacy = vit_training_flops_legacy(num_vision_patches=3, batch=5, **dims)
    assert isinstance(legacy, Fraction)
    assert legacy == 3 * 2 * ((8 * 256 + 4 * 16 * 32) * 3 + 4 * 16 * Fraction(9, 5))

    with pytest.raises(TypeError):
        vit_training_flops_legacy(num_vision_patches=sympy.Symbol("P"), batch=2, **dims)


# ----------------------------------------------------------------------------------------- PaLM / nanoGPT / torchtitan


class _NanoGPTShapes(nn.Module):
    """GPT-2 124M shapes as in nanoGPT (biases on, tied wte / lm_head), on the meta device."""

    def __init__(self, vocab=50257, block=1024, L=12, d=768):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.h = nn.ModuleList(
            nn.ModuleDict({"ln_1": nn.LayerNorm(d), "c_attn": nn.Linear(d, 3 * d), "attn_proj": nn.Linear(d, d),
                               "ln_2": nn.LayerNorm(d), "c_fc": nn.Linear(d, 4 * d), "mlp_proj": nn.Linear(4 * d, d)})
            for _ in range(L)
        )
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied


def test_gpt2_124m_palm_nanogpt_torchtitan():
    V, T, L, d, H = 50257, 1024, 12, 768, 12
    per_layer = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    total = V * d + T * d + L * per_layer + 2 * d
    assert total == 124_439_808  # GPT-2 small, as published
    n_nanogpt = total - T * d  # nanoGPT get_num_params(): minus wpe, tied wte kept
    expected = 6 * n_nanogpt + 12 * L * H * (d // H) * T
    assert expected == 855_166_464
    assert palm_flops_per_token(n_params=n_nanogpt, layers=L, heads=H, head_dim=d // H, seq=T) == expected

    with torch.device("meta"):
        model = _NanoGPTShapes()
    assert sum(p.numel() for p in model.parameters()) == total
    assert params_excluding(model, [model.wpe]) == n_nanogpt
    # torchtitan: minus nn.Embedding params, but the tied wte is kept as the lm_head -> same N here
    assert non_embedding_params(model) == n_nanogpt
    assert torchtitan_flops_per_token(n_matmul_params=non_embedding_params(model), layers=L, heads=H,
                                      head_dim=d // H, seq=T) == expected
    # untie: the embedding is then excluded
    model.lm_head.weight = nn.Parameter(torch.empty(V, d, device="meta"))
    assert non_embedding_params(model) == n_nanogpt  # wte dropped, the new lm_head added: same count
    assert sum(p.numel() for p in model.parameters()) == total + V * d

    # nanoGPT per iteration: 12 sequences × 40 grad-accum steps of T tokens
    assert palm_flops_per_iter(flops_per_token=expected, seq=T, fwdbwd_per_iter=12 * 40) == expected * T * 480


def test_palm_attention_is_twice_megatron_causal_core():
    T = sympy.Symbol("T", positive=True)
    L, n, d = 4, 8, 16
    palm = palm_flops_per_token(n_params=0, layers=L, heads=n, head_dim=d, seq=T)
    # Megatron on one unpacked sequence of length T, per token: core 6·L·q·T²/T
    megatron_core = gpt_training_flops(tokens=T, sum_seq_squared=T**2, layers=L, hidden=n * d, ffn_hidden=0,
                                       heads=n, vocab=sympy.Symbol("V"), make_vocab_size_divisible_by=1)
    core_coefficient = sympy.Poly(sympy.expand(megatron_core), T).coeff_monomial(T**2)
    assert sympy.expand(palm) == 2 * core_coefficient * T


def test_torchtitan_moe_active_params():
    assert torchtitan_moe_active_params(non_routed_params=1000, routed_expert_params=640, topk=2,
                                        num_experts=8) == 1160
    assert torchtitan_moe_active_params(non_routed_params=1, routed_expert_params=1, topk=1,
                                        num_experts=3) == Fraction(4, 3)
    E = sympy.Symbol("E", positive=True)
    assert torchtitan_moe_active_params(non_routed_params=0, routed_expert_params=6, topk=1, num_experts=E) == 6 / E


# ----------------------------------------------------------------------------------------- HF


def test_hf_floating_point_ops():
    assert hf_floating_point_ops(n_params=124_439_808, tokens=8 * 1024) == 6 * 124_439_808 * 8192
    N, tok = sympy.symbols("N tokens", positive=True)
    assert hf_floating_point_ops(n_params=N, tokens=tok) == 6 * N * tok
    # the VLM bug: vision params billed per text token, independent of the patch count
    text_n, vision_n, text_tokens = 1000, 300, 50
    assert hf_floating_point_ops(n_params=text_n + vision_n, tokens=text_tokens) - hf_floating_point_ops(
        n_params=text_n, tokens=text_tokens) == 6 * vision_n * text_tokens
    with pytest.raises(TypeError):
        hf_floating_point_ops(n_params=1.0, tokens=2)
