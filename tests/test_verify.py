"""fxflops.verify and conventions: hand formulas checked against traced programs, term by term."""

from __future__ import annotations

import random

import pytest
import sympy
import torch

import fxflops
from fxflops.conventions import FLOPCOUNTER, MEGATRON, PALM, Convention
from fxflops.formulas import gpt_training_flops, non_embedding_params, palm_flops_per_token
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, forward_flops_formula, random_batch
from fxflops.testing import assert_formula
from fxflops.verify import _plain  # torch's FloorDiv as sympy floor, as verify compares

GPT = GPTConfig(vocab=1024, hidden=96, heads=6, kv_heads=2, ffn=256, layers=2)  # vocab: a multiple of 128


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    program = fxflops.trace(model, (torch.randint(0, 1024, (2, 9)),), dims={"input_ids": {0: "batch", 1: "seq"}}, backward=True)
    return model, program


def megatron(batch, seq):
    """Megatron-LM's training FLOPs for this GPT (fxflops.formulas, written from its published math)."""
    return gpt_training_flops(
        tokens=batch * seq, sum_seq_squared=batch * seq**2, layers=GPT.layers, hidden=GPT.hidden,
        ffn_hidden=GPT.ffn, heads=GPT.heads, query_groups=GPT.kv_heads, kv_channels=GPT.head_dim,
        vocab=GPT.vocab, glu=True,
    )


def test_megatron_gpt_equals_megatron_formula_symbolically(gpt):
    _, program = gpt
    verdict = assert_formula(program, megatron, convention=MEGATRON)
    assert verdict.difference == 0


def test_flopcounter_convention_differs_from_megatron_by_the_attention_core_only(gpt):
    """Traced (FlopCounterMode convention): causal not halved and the fused attention backward is
    2.5x its forward: core 4 + 10 = 14·L·q·b·s² against Megatron's 6·L·q·b·s²; every GEMM agrees."""
    _, program = gpt
    verdict = fxflops.verify(program, megatron, convention=FLOPCOUNTER)
    batch, seq = sympy.symbols("batch seq", integer=True, positive=True)
    q = GPT.heads * GPT.head_dim
    assert sympy.expand(verdict.difference.subs({s: sympy.Symbol(str(s), integer=True, positive=True) for s in verdict.difference.free_symbols}) - 8 * GPT.layers * q * batch * seq**2) == 0
    assert list(verdict.by_module) == ["layers.*.attn"]
    assert "layers.*.attn" in str(verdict)


def test_palm_formula_differences_are_the_expected_terms(gpt):
    """PaLM/nanoGPT 6N + 12·L·H·Q·T: N includes the RMSNorm weights, which do no matmul, so the
    formula has 6·N_norm extra FLOPs per token; under Megatron's causal halving its attention term is
    also twice the traced one (12 vs 6·L·q·s per token)."""
    model, program = gpt
    n_params = non_embedding_params(model)
    n_norm = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)

    def palm(batch, seq):
        return batch * seq * palm_flops_per_token(n_params=n_params, layers=GPT.layers, heads=GPT.heads, head_dim=GPT.head_dim, seq=seq)

    batch, seq = (sympy.Symbol(n, integer=True, positive=True) for n in ("batch", "seq"))
    verdict = fxflops.verify(program, palm, convention=PALM)
    assert sympy.expand(_rename(verdict.difference) + 6 * n_norm * batch * seq) == 0
    halved = fxflops.verify(program, palm, convention=MEGATRON)
    q = GPT.heads * GPT.head_dim
    assert sympy.expand(_rename(halved.difference) + 6 * n_norm * batch * seq + 6 * GPT.layers * q * batch * seq**2) == 0


def _rename(expr):
    return expr.xreplace({s: sympy.Symbol(str(s), integer=True, positive=True) for s in expr.free_symbols})


@pytest.fixture(scope="module")
def vlm():
    cfg = VLMConfig()
    torch.manual_seed(0)
    program = fxflops.trace(
        TinyVLM(cfg), random_batch(cfg, random.Random(0)).inputs(),
        dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}},
        segments={"cu_seqlens": "text", "image_grid_thw": "frames"},
    )
    return cfg, program


def test_correct_vlm_formula_verifies(vlm):
    cfg, program = vlm
    assert_formula(program, lambda tokens, patches, text_p2, frames_p2: forward_flops_formula(cfg, tokens, patches, text_p2, frames_p2))


def _wrong_formulas(cfg):
    right = lambda *sizes: forward_flops_formula(cfg, *sizes)  # noqa: E731
    width = cfg.merge**2 * cfg.vision_hidden
    merger = 2 * (width * width + width * cfg.hidden)
    return {
        "no vision term": (lambda tokens, patches, text_p2, frames_p2: right(tokens, 0, text_p2, 0), "missing visual"),
        "pack length squared": (
            lambda tokens, patches, text_p2, frames_p2: right(tokens, patches, tokens**2, frames_p2),
            "language_model.layers.*.self_attn: counted at tokens**2, traced text_p2",
        ),
        "merger counted 4x": (
            lambda tokens, patches, text_p2, frames_p2: right(tokens, patches, text_p2, frames_p2) + 3 * merger * (patches // 4),
            "counted 4x: visual.merger",
        ),
        "static seq_length": (
            lambda tokens, patches, text_p2, frames_p2: right(4096, patches, text_p2, frames_p2),
            "language_model, lm_head",
        ),
        "virtual pipeline x2": (
            lambda tokens, patches, text_p2, frames_p2: 2 * right(tokens, patches, text_p2, frames_p2),
            "counted 2x: <model>",
        ),
    }


@pytest.mark.parametrize("bug", list(_wrong_formulas(VLMConfig())))
def test_wrong_vlm_formulas_are_caught_and_attributed(vlm, bug):
    cfg, program = vlm
    formula, expected = _wrong_formulas(cfg)[bug]
    verdict = fxflops.verify(program, formula)
    assert not verdict.equal and verdict.relative_error > 0
    assert any(expected in str(a) for a in verdict.attributions), str(verdict)
    with pytest.raises(AssertionError, match="DIFFERENT"):
        assert_formula(program, formula)


def test_numeric_formula_is_sampled(vlm):
    """A formula that cannot take symbols (math.ceil on a size) is compared on sampled values."""
    import math

    cfg, program = vlm

    def with_ceil(tokens, patches, text_p2, frames_p2):
        return forward_flops_formula(cfg, tokens, patches, text_p2, frames_p2) + 0 * math.ceil(tokens / 7)

    verdict = fxflops.verify(program, with_ceil, samples=50)
    assert verdict.equal and verdict.difference is None and verdict.samples == 50


def test_causal_conventions_on_packed_text():
    """Causal varlen attention per sequence of s tokens: full 4·H·D·s², half 2·H·D·s², exact
    2·H·D·s(s+1) (query-key pairs of the lower triangle), summed over the packed sequences."""
    cfg = VLMConfig(vision_layers=1, layers=1)
    torch.manual_seed(0)
    model = TinyVLM(cfg)
    batch = random_batch(cfg, random.Random(3), sequences=(3, 6))
    program = fxflops.trace(model, batch.inputs(), dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}})
    lengths = batch.sequence_lengths
    h = cfg.hidden  # heads · head_dim
    full = program.total(convention=FLOPCOUNTER, **_sizes(program, batch))
    half = program.total(convention=FLOPCOUNTER.but(causal="half"), **_sizes(program, batch))
    exact = program.total(convention=FLOPCOUNTER.but(causal="exact"), **_sizes(program, batch))
    assert full - half == sum(2 * h * s * s for s in lengths)
    assert full - exact == sum(4 * h * s * s - 2 * h * s * (s + 1) for s in lengths)
    macs = program.total(convention=FLOPCOUNTER.but(unit="macs"), **_sizes(program, batch))
    assert 2 * macs == full


def _sizes(program, batch):
    """Every symbol's value for this batch (each convention uses the ones it needs)."""
    return dict(zip(map(str, program.all_symbols), program.binder.values(batch.inputs(), {})))


def test_count_all_and_embeddings_add_documented_costs():
    """count='all' adds the elementwise costs (e.g. SiLU and the gating multiply: 1 per element each);
    embeddings=True adds one per gathered element. The matmul part is unchanged."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=1))
    program = fxflops.trace(model, (torch.randint(0, 100, (2, 5)),), dims={"input_ids": {0: "b", 1: "s"}})
    matmul = program.total(b=2, s=5)
    everything = program.total(convention=FLOPCOUNTER.but(count="all"), b=2, s=5)
    mlp_elementwise = program.total(convention=FLOPCOUNTER.but(count="all"), b=2, s=5) - matmul
    assert everything > matmul and mlp_elementwise >= 2 * 2 * 5 * 48  # silu + multiply over (b, s, ffn)
    with_embeddings = program.total(convention=FLOPCOUNTER.but(embeddings=True), b=2, s=5)
    assert with_embeddings - matmul == 2 * 5 * 32
    assert "embedding gathers counted" in program.table(convention=FLOPCOUNTER.but(embeddings=True), b=2, s=5)


def test_convention_rejects_unknown_choices():
    with pytest.raises(ValueError, match="causal"):
        Convention(causal="quarter")


def test_bridge_vit_formula_against_the_vision_tower(vlm):
    """Megatron-Bridge's ViT formula (from grid_thw statistics) leaves the patch-embedding Conv3d out
    by design: verified on the ``visual`` subtree under MEGATRON, the only difference is exactly that
    module."""
    from fxflops.formulas import vit_training_flops

    cfg = VLMConfig()
    torch.manual_seed(0)
    program = fxflops.trace(
        TinyVLM(cfg), random_batch(cfg, random.Random(0)).inputs(),
        dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}},
        segments={"cu_seqlens": "text", "image_grid_thw": "frames"}, backward=True,
    )

    def bridge(patches, frames_p2):
        return vit_training_flops(
            sum_patches=patches, sum_patches_squared=frames_p2, sum_merged_patches=patches // cfg.merge**2,
            depth=cfg.vision_layers, hidden=cfg.vision_hidden, intermediate=cfg.vision_mlp,
            spatial_merge_size=cfg.merge, out_hidden=cfg.hidden,
        )

    verdict = fxflops.verify(program, bridge, convention=MEGATRON, module="visual")
    assert list(verdict.by_module) == ["visual.patch_embed"] and verdict.unexplained == 0
    assert "missing visual.patch_embed" in str(verdict)


@pytest.fixture(scope="module")
def hf_qwen2_vl():
    """The tiny Qwen2-VL of the zoo, its program, and its vision config (the numbers a hand formula
    is written from)."""
    pytest.importorskip("transformers")
    from fxflops.models import hf_zoo

    model = hf_zoo.build("qwen2_vl", "sdpa")
    wrapper = fxflops.instrument(model, strict=True)
    with torch.no_grad():
        wrapper(**hf_zoo.random_batch("qwen2_vl", random.Random(1)))
    return wrapper.program, model.config.vision_config, model.config.get_text_config()


def _vit_formula(vision, text, *, patch_embedding=True, merger_tokens=lambda p: p // 4):
    """A hand formula for Qwen2-VL's vision tower, per patch P and per-image attention Σsᵢ² = p2:
    patch embedding 2·P·(C·T·p²)·D, per block QKV + output projection 2·P·4D², attention core
    4·D·p2, MLP 2·P·2·D·(r·D); merger 2·(P/4)·(4D·4D + 4D·H_text)."""
    d, depth = vision.embed_dim, vision.depth
    mlp = int(d * vision.mlp_ratio)
    merged = d * vision.spatial_merge_size**2
    pixels = vision.in_chans * vision.temporal_patch_size * vision.patch_size**2

    def formula(patches, image_cu_seqlens_p2):
        embedding = 2 * patches * pixels * d if patch_embedding else 0
        blocks = depth * (2 * patches * 4 * d * d + 4 * d * image_cu_seqlens_p2 + 2 * patches * 2 * d * mlp)
        return embedding + blocks + 2 * merger_tokens(patches) * (merged * merged + merged * text.hidden_size)

    return formula


def test_relations_from_the_capture(hf_qwen2_vl):
    program, _, _ = hf_qwen2_vl
    p1, p2, patches = (next(s for s in program.all_symbols if str(s) == n) for n in ("image_cu_seqlens_p1", "image_cu_seqlens_p2", "patches"))
    assert sympy.Eq(p1, patches) in program.relations  # the lifted attention's segments cover the patches
    assert sympy.Le(p1, p2) in program.relations and sympy.Le(p2, p1**2) in program.relations


def test_the_hand_vit_formula_verifies_under_the_relations(hf_qwen2_vl):
    """The traced attention projections are Σᵢ c·sᵢ = c·p1 (per segment); the formula's are c·P: equal
    because p1 = P in every call."""
    program, vision, text = hf_qwen2_vl
    assert fxflops.verify(program, _vit_formula(vision, text), module="model.visual").equal


def test_a_left_out_patch_embedding_is_named(hf_qwen2_vl):
    program, vision, text = hf_qwen2_vl
    verdict = fxflops.verify(program, _vit_formula(vision, text, patch_embedding=False), module="model.visual")
    embedding = 2 * vision.in_chans * vision.temporal_patch_size * vision.patch_size**2 * vision.embed_dim
    assert [str(a) for a in verdict.attributions] == [f"missing model.visual.patch_embed (the formula leaves out {embedding}*patches)"]
    assert verdict.unexplained == 0


def test_a_merger_counted_at_the_wrong_token_count_is_named(hf_qwen2_vl):
    program, vision, text = hf_qwen2_vl
    verdict = fxflops.verify(program, _vit_formula(vision, text, merger_tokens=lambda p: 5 * (p // 20)), module="model.visual")
    (attribution,) = verdict.attributions
    assert str(attribution).startswith("model.visual.merger: counted at 5*floor(patches/20), traced floor(patches/4)")
    assert verdict.unexplained == 0


def test_a_padded_vocabulary_is_put_on_lm_head_and_called_ambiguous():
    """A formula with Megatron's padded vocabulary (500 -> 512) differs by 2·H·12 per token, which
    any projection counted with another size could explain too: the smallest change of size (the
    vocabulary) comes first, and the term is reported as ambiguous rather than put on one wrong module."""
    from dataclasses import replace

    from fxflops.formulas import padded_vocab

    cfg = replace(VLMConfig(), vocab=500, image_token_id=499)
    torch.manual_seed(0)
    program = fxflops.trace(
        TinyVLM(cfg), random_batch(cfg, random.Random(0)).inputs(),
        dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}},
        segments={"cu_seqlens": "text", "image_grid_thw": "frames"},
    )
    padded = replace(cfg, vocab=padded_vocab(cfg.vocab, 128))
    verdict = fxflops.verify(program, lambda tokens, patches, text_p2, frames_p2: forward_flops_formula(padded, tokens, patches, text_p2, frames_p2))
    extra = 2 * cfg.hidden * (padded.vocab - cfg.vocab)
    (attribution,) = verdict.attributions
    assert str(attribution).startswith(f"ambiguous extra {extra}*tokens: lm_head counted with size {padded.vocab} where the model has {cfg.vocab} or ")
    assert list(verdict.by_module) == ["lm_head"] and verdict.unexplained == 0


def test_a_coefficient_that_coincides_with_a_module_is_ambiguous(vlm):
    """A formula counting every k_proj twice matches k_proj exactly, and v_proj (the same polynomial
    under grouped-query attention) just as well; lm_head counted with a vocabulary larger by
    k_proj's share of lm_head explains the same term with a smaller change of its module (12.5%,
    not 100%): ambiguous, lm_head first, then k_proj and v_proj counted twice."""
    cfg, program = vlm
    k_proj = cfg.layers * 2 * cfg.hidden * cfg.kv_heads * (cfg.hidden // cfg.heads)
    verdict = fxflops.verify(
        program, lambda tokens, patches, text_p2, frames_p2: forward_flops_formula(cfg, tokens, patches, text_p2, frames_p2) + k_proj * tokens
    )
    (attribution,) = verdict.attributions
    vocab = cfg.vocab + k_proj // (2 * cfg.hidden)  # 2·H·V′ = 2·H·V + k_proj
    assert str(attribution).startswith(f"ambiguous extra {k_proj}*tokens: lm_head counted with size ")
    assert f"{vocab} where the model has {cfg.vocab}" in str(attribution)
    assert str(attribution).endswith(
        "language_model.layers.*.self_attn.k_proj counted 2x or language_model.layers.*.self_attn.v_proj counted 2x (or 6 more)"
    )


def test_attention_over_an_average_image_is_named(hf_qwen2_vl):
    """Bridge's legacy form: the per-image attention core over P̄ = P/B patches per sample,
    B·P̄² = P²/B, instead of Σᵢ sᵢ² over the real images."""
    program, vision, text = hf_qwen2_vl
    right = _vit_formula(vision, text)
    core = vision.depth * 4 * vision.embed_dim

    def averaged(patches, image_cu_seqlens_p2, batch):
        return right(patches, image_cu_seqlens_p2) - core * image_cu_seqlens_p2 + core * patches**2 / batch

    verdict = fxflops.verify(program, averaged, module="model.visual")
    (attribution,) = verdict.attributions
    assert str(attribution).startswith("model.visual.blocks.*.attn: counted at patches**2/batch, traced image_cu_seqlens_p2")
    assert verdict.unexplained == 0


def _patch_positions(family: str, config, symbols: dict):
    """Output positions of a family's patch-embedding convolution, in the program's symbols, from the
    config: Qwen-VL towers take pre-cut patches (one position each); CLIP a fixed image size;
    SigLIP and Gemma 3 a size given per call (height and width cut into patches)."""
    vision = config.vision_config
    if family.startswith("qwen"):
        return symbols["patches"]
    if family == "llava_clip":
        return symbols["images"] * (vision.image_size // vision.patch_size) ** 2
    return symbols["images"] * (symbols["height"] // vision.patch_size) * (symbols["width"] // vision.patch_size)


def _zoo_program(family: str):
    """The zoo family's tiny model (sdpa) and the program of one random microbatch with images."""
    pytest.importorskip("transformers")
    from fxflops.models import hf_zoo

    model = hf_zoo.build(family, "sdpa")
    wrapper = fxflops.instrument(model, strict=True)
    with torch.no_grad():
        wrapper(**hf_zoo.random_batch(family, random.Random(2)))
    return model, wrapper.program


@pytest.mark.long
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava_clip", "llava_siglip", "gemma3"])
def test_a_left_out_patch_embedding_is_named_in_every_zoo_family(family):
    """A formula that is the traced vision tower less the patch embedding (2 FLOPs per weight per
    output position, from the conv's weight and the config) names the patch embedding's module, or
    an ancestor that holds only it, and nothing else."""
    model, program = _zoo_program(family)
    (conv_path, conv), = [(n, m) for n, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    tower = conv_path.split(".embeddings")[0].split(".patch_embed")[0]
    symbols = {str(s): s for s in program.all_symbols}
    left_out = _plain(2 * conv.weight.numel() * _patch_positions(family, model.config, symbols))
    formula = sympy.expand(_plain(program.formula(tower)) - left_out)
    verdict = fxflops.verify(program, formula, module=tower)
    (attribution,) = verdict.attributions
    assert verdict.unexplained == 0 and attribution.factor == 1
    assert conv_path.startswith(attribution.where) and sympy.expand(_plain(program.formula(attribution.where)) - left_out) == 0
    assert str(attribution) == f"missing {attribution.where} (the formula leaves out {left_out})"


def _projector_weights(module: torch.nn.Module) -> int:
    """Multiply-adds per token of a projector: its linear layers' weights and its own 2-D weight
    parameters (Gemma 3's ``mm_input_projection_weight``)."""
    linears = sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
    return linears + sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 2)


def _merger_bug(family: str, model, symbols: dict):
    """(the merger module, its tokens, the tokens a buggy formula counts it at), from the config:
    Qwen-VL mergers join spatial_merge_size² patches (the buggy count 5·⌊P/20⌋); LLaVA's projector
    takes the tower's patches without CLS (the buggy count keeps one more per image); Gemma 3's
    pools them to mm_tokens_per_image (the buggy count is before pooling)."""
    vision = model.config.vision_config
    if family.startswith("qwen"):
        merged = symbols["patches"] // vision.spatial_merge_size**2
        return "model.visual.merger", merged, 5 * (symbols["patches"] // 20)
    images, per_side = symbols["images"], vision.image_size // vision.patch_size
    if family == "gemma3":
        patches = images * (symbols["height"] // vision.patch_size) * (symbols["width"] // vision.patch_size)
        return "model.multi_modal_projector", images * model.config.mm_tokens_per_image, patches
    if family == "llava_siglip":
        patches = images * (symbols["height"] // vision.patch_size) * (symbols["width"] // vision.patch_size)
    else:
        patches = images * per_side**2
    return "model.multi_modal_projector", patches, patches + images


@pytest.mark.long
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava_clip", "llava_siglip", "gemma3"])
def test_formula_bugs_are_named_in_every_zoo_family(family):
    """Three hand-formula bugs on each zoo family, each formula the traced model with one part
    replaced by its hand count (from the config and the weights):

    - a vocabulary padded to a multiple of 384 (Megatron's 128 x tensor-parallel 3): lm_head first,
      ambiguous (a projection counted twice gives the same term on these tiny models);
    - the merger at the wrong token count: named "counted at T', traced T" where the sizes tell it
      (Qwen: floors; Gemma 3: before pooling), with Qwen3-VL's one deepstack merger, which has the
      very same polynomial, named beside it; on LLaVA's projector one token more per image is only a
      coefficient (16 vs 17 tokens of one size), which other layers explain as well: ambiguous;
    - Qwen-VL towers: attention over an average image, P²/B instead of Σ sᵢ² (fixed-size towers have
      one image size: the average is exact there).

    Never a "not in any traced module" rest."""
    model, program = _zoo_program(family)
    symbols = {str(s): s for s in program.all_symbols}
    traced = _plain(program.formula())
    text = model.config.get_text_config()
    padded = -(-text.vocab_size // 384) * 384
    extra = 2 * text.hidden_size * (padded - text.vocab_size)
    verdict = fxflops.verify(program, traced + extra * symbols["batch"] * symbols["seq"])
    (attribution,) = verdict.attributions
    assert str(attribution).startswith(f"ambiguous extra {extra}*batch*seq: lm_head counted with size ")
    assert f"{padded} where the model has {text.vocab_size}" in str(attribution)
    assert list(verdict.by_module) == ["lm_head"] and verdict.unexplained == 0

    merger, tokens, buggy = _merger_bug(family, model, symbols)
    per_token = 2 * _projector_weights(model.get_submodule(merger))
    assert sympy.expand(_plain(program.formula(merger)) - per_token * _plain(tokens)) == 0  # the hand count of the merger
    verdict = fxflops.verify(program, sympy.expand(traced + per_token * _plain(buggy - tokens)))
    (attribution,) = verdict.attributions
    assert verdict.unexplained == 0
    if family.startswith("llava"):
        assert str(attribution).startswith(f"ambiguous extra {per_token * (buggy - tokens)}: ")
    else:
        shown = f"{merger}: counted at {_plain(buggy)}, traced {_plain(tokens)}"
        if family.startswith("qwen3"):  # one deepstack merger: the same polynomial as the merger
            shown = f"{merger} counted at {_plain(buggy)}, traced {_plain(tokens)} or model.visual.deepstack_merger_list counted at"
        assert shown in str(attribution) and list(verdict.by_module) == [merger]

    if family.startswith("qwen"):
        vision = model.config.vision_config
        full = len(getattr(vision, "fullatt_block_indexes", None) or range(vision.depth))  # blocks attending per image
        width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL names it embed_dim
        core = 4 * width * full  # SDPA forward per block: 4·(heads·head_dim)·Σ sᵢ²
        p2, patches, batch = symbols["image_cu_seqlens_p2"], symbols["patches"], symbols["batch"]
        verdict = fxflops.verify(program, sympy.expand(traced - core * p2 + core * patches**2 / batch))
        (attribution,) = verdict.attributions
        assert str(attribution).startswith("model.visual.blocks.*.attn: counted at patches**2/batch, traced image_cu_seqlens_p2")
        assert verdict.unexplained == 0
