"""Mixture-of-experts models. Zero-config transformers models: Mixtral and Qwen2-MoE (router, routed
experts, and Qwen2-MoE's shared expert) from tiny random configs; and a plain-torch MoE GPT against
Megatron's MoE formula.

References, per random batch: FlopCounterMode on the same batch through the model with the eager
experts loop (each expert's matmuls on the tokens routed to it) and eager attention, forward and
forward + ``loss.backward()``, per module (forward from FlopCounterMode, training by replaying each
module alone); and the textbook cost of the routed experts from the config alone,
2·top_k·tokens·(3·hidden·expert_ffn) per layer forward for SwiGLU experts.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import fxflops
from fxflops.conventions import FLOPCOUNTER, MEGATRON
from fxflops.formulas import gpt_training_flops
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT
from fxflops.routing import dispatched_flops
from fxflops.testing import assert_formula
from reference import MODEL_FLOPS, assert_training_call_matches, reference_counts, training_reference_total

transformers = pytest.importorskip("transformers")

BATCHES = 30  # random batches of the capacity-dispatch test
FAMILY_BATCHES = 12  # per HF MoE family and attention (sdpa in the long suite)
HIDDEN, EXPERT_FFN, EXPERTS, TOP_K, LAYERS = 64, 48, 4, 2, 2


def mixtral(attn: str) -> torch.nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=512,
    )
    return _build(transformers.MixtralForCausalLM, config, attn)


def qwen2_moe(attn: str) -> torch.nn.Module:
    config = transformers.Qwen2MoeConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=EXPERT_FFN,
        shared_expert_intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1, max_position_embeddings=512,
    )
    return _build(transformers.Qwen2MoeForCausalLM, config, attn)


def _build(cls, config, attn: str) -> torch.nn.Module:
    config._attn_implementation = attn
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).eval()


FAMILIES = {"mixtral": mixtral, "qwen2_moe": qwen2_moe}


def random_batch(rng: random.Random) -> dict:
    batch, length = rng.randint(1, 3), rng.randint(3, 40)
    lengths = [rng.randint(1, length) for _ in range(batch)]
    lengths[0] = length
    ids = torch.tensor([[rng.randrange(1, 256) for _ in range(n)] + [0] * (length - n) for n in lengths])
    mask = torch.tensor([[1] * n + [0] * (length - n) for n in lengths])
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def moe_modules(model: torch.nn.Module) -> list[str]:
    """Router, routed experts, shared expert and its gate of every MoE block, plus the head."""
    parts = ("mlp.gate", "mlp.experts", "mlp.shared_expert", "mlp.shared_expert_gate")
    return [p for p, _ in model.named_modules() if p.endswith(parts)] + ["model.layers.0", "lm_head"]


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.long)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_counts_equal_flop_counter_per_module(family, attn):
    reference = FAMILIES[family]("eager")
    wrapper = fxflops.instrument(FAMILIES[family](attn), backward=True, strict=True, measure_routing=True)
    modules = moe_modules(reference)
    rng = random.Random(f"{family}-{attn}")
    for i in range(FAMILY_BATCHES):
        batch = random_batch(rng)
        got_forward, got_training, _, _ = assert_training_call_matches(wrapper, reference, batch, modules, (family, attn, i))
        tokens = batch["input_ids"].numel()
        for layer in range(LAYERS):  # every token through top_k SwiGLU experts: the textbook cost
            experts = f"model.layers.{layer}.mlp.experts"
            assert got_forward[experts] == 2 * TOP_K * tokens * 3 * HIDDEN * EXPERT_FFN, (family, i)
        # measured on the eager experts loop: transformers' dropless routing, so actual = model
        assert wrapper.flops.breakdown(convention=MODEL_FLOPS.but(moe="actual")) == got_training
    assert wrapper.captures == 1 and wrapper.flops.uncounted == 0


def test_router_and_shared_expert_are_their_own_modules():
    program = fxflops.trace(qwen2_moe("eager"), kwargs=random_batch(random.Random(0)))
    block = "model.layers.0.mlp"
    named = {str(s): s for s in program.symbols}
    assert set(named) == {"batch", "seq"}
    tokens = named["batch"] * named["seq"]
    assert program.formula(f"{block}.gate") == 2 * HIDDEN * EXPERTS * tokens  # the router GEMM
    assert program.formula(f"{block}.shared_expert") == 2 * 3 * HIDDEN * 96 * tokens
    assert program.formula(f"{block}.experts") == 2 * TOP_K * 3 * HIDDEN * EXPERT_FFN * tokens


MOE_GPT = GPTConfig(vocab=256, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, experts=6, top_k=2, expert_ffn=16, shared_ffn=24)


def megatron_moe(batch, seq):
    """Megatron-LM's training FLOPs for the MoE GPT (fxflops.formulas, from its published math):
    routed experts at top-k, the shared expert, the router GEMM not counted."""
    cfg = MOE_GPT
    return gpt_training_flops(
        tokens=batch * seq, sum_seq_squared=batch * seq**2, layers=cfg.layers, hidden=cfg.hidden, ffn_hidden=cfg.ffn,
        heads=cfg.heads, query_groups=cfg.kv_heads, kv_channels=cfg.head_dim, vocab=cfg.vocab, glu=True,
        moe_layers=cfg.layers, moe_ffn_hidden=cfg.expert_ffn, moe_topk=cfg.top_k, shared_expert_ffn_hidden=cfg.shared_ffn,
    )


@pytest.fixture(scope="module")
def moe_gpt():
    torch.manual_seed(0)
    model = TinyGPT(MOE_GPT)
    ids = torch.randint(0, MOE_GPT.vocab, (2, 9))
    return model, fxflops.trace(model, (ids,), dims={"input_ids": {0: "batch", 1: "seq"}}, backward=True)


def test_megatron_moe_formula_verifies_exactly(moe_gpt):
    _, program = moe_gpt
    assert assert_formula(program, megatron_moe, convention=MEGATRON).difference == 0


def test_router_is_what_flopcounter_counts_and_megatron_does_not(moe_gpt):
    """Training, traced: the router GEMM (2·tokens·hidden·experts forward, twice that backward) is
    counted under FLOPCOUNTER and not under MEGATRON; FlopCounterMode agrees with the traced total."""
    model, program = moe_gpt
    ids = torch.randint(0, MOE_GPT.vocab, (3, 11))
    router = program.total(convention=FLOPCOUNTER, batch=3, seq=11) - program.total(convention=FLOPCOUNTER.but(router=False), batch=3, seq=11)
    assert router == MOE_GPT.layers * 3 * (2 * 3 * 11 * MOE_GPT.hidden * MOE_GPT.experts)
    assert program.total(batch=3, seq=11) == training_reference_total(model, ids)


CAPACITY_GPT = GPTConfig(vocab=256, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, experts=4, top_k=2,
                         expert_ffn=16, dispatch="grouped", capacity_factor=0.75)
ACTUAL = FLOPCOUNTER.but(moe="actual")


def _pair(cfg: GPTConfig):
    """The grouped-GEMM capacity MoE GPT and its reference twin: the same weights and routing, one
    matmul per expert on the rows it kept (``dispatch="loop"``), which FlopCounterMode counts."""
    torch.manual_seed(0)
    grouped = TinyGPT(cfg)
    loop = TinyGPT(dataclasses.replace(cfg, dispatch="loop"))
    loop.load_state_dict(grouped.state_dict())
    return grouped, loop


@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_actual_counts_what_the_capacity_dispatch_computed(dispatch):
    """30 random batches: ``actual`` equals FlopCounterMode's count of the per-expert loop on the kept
    rows (forward per module, and forward + backward), ``model`` is top_k x tokens x expert cost,
    for a sorted-token grouped GEMM and for a Python loop over the experts (data-dependent groups)."""
    grouped, loop = _pair(dataclasses.replace(CAPACITY_GPT, dispatch=dispatch))
    wrapper = fxflops.instrument(grouped, dims={"input_ids": {0: "batch", 1: "seq"}}, backward=True, measure_routing=True, strict=True)
    rng = random.Random(3)
    dropped = 0
    for i in range(BATCHES):
        ids = torch.randint(0, 256, (rng.randint(1, 3), rng.randint(2, 40)), generator=torch.Generator().manual_seed(i))
        wrapper.flops.reset()
        wrapper(ids).sum().backward()
        forward = reference_counts(loop, ids)
        got = wrapper.flops.breakdown(phase="fwd", convention=ACTUAL)
        model = wrapper.flops.breakdown(phase="fwd")
        for layer in range(CAPACITY_GPT.layers):
            experts = f"layers.{layer}.mlp.experts"
            assert got[experts] == forward[experts], (i, experts)
            assert model[experts] == 2 * CAPACITY_GPT.top_k * ids.numel() * 3 * CAPACITY_GPT.hidden * CAPACITY_GPT.expert_ffn
            dropped += model[experts] - got[experts]
        assert got[""] == forward[""], i
        assert wrapper.flops.total(convention=ACTUAL) == training_reference_total(loop, ids), i
    assert dropped > 0 and wrapper.captures == 1  # the capacity dropped pairs, one program served all


def test_forced_routing_changes_actual_not_model():
    """All router scores equal: every token picks the same top_k experts, which keep only their
    capacity; the tokens and so the ``model`` count are unchanged."""
    grouped, _ = _pair(CAPACITY_GPT)
    wrapper = fxflops.instrument(grouped, dims={"input_ids": {0: "batch", 1: "seq"}}, measure_routing=True, strict=True)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wrapper(ids)
        spread = (wrapper.flops.total(), wrapper.flops.total(convention=ACTUAL))
        for layer in grouped.layers:
            layer.mlp.router.weight.zero_()
        wrapper.flops.reset()
        wrapper(ids)
        forced = (wrapper.flops.total(), wrapper.flops.total(convention=ACTUAL))
    assert forced[0] == spread[0] and forced[1] < spread[1]
    tokens, cfg = ids.numel(), CAPACITY_GPT
    capacity = -(-3 * tokens * cfg.top_k // (4 * cfg.experts))  # ceil(0.75 · pairs / experts)
    per_pair = 2 * 3 * cfg.hidden * cfg.expert_ffn
    experts = wrapper.flops.breakdown(convention=ACTUAL)["layers.0.mlp.experts"]
    assert experts == cfg.top_k * min(tokens, capacity) * per_pair  # experts 0..top_k-1, each at capacity


def test_actual_needs_measured_routing():
    grouped, _ = _pair(CAPACITY_GPT)
    wrapper = fxflops.instrument(grouped, dims={"input_ids": {0: "batch", 1: "seq"}}, strict=True)
    with torch.no_grad():
        wrapper(torch.randint(0, 256, (2, 9)))
    assert wrapper.flops.total() > 0
    with pytest.raises(ValueError, match="measure_routing=True"):
        wrapper.flops.total(convention=ACTUAL)
    with pytest.raises(ValueError, match="measure_routing=True"):
        wrapper.program.total(convention=ACTUAL, batch=2, seq=9)


def test_dropless_transformers_moe_actual_equals_model():
    """transformers routers drop nothing: measured on the eager experts loop, ``actual`` is ``model``."""
    model = mixtral("eager")
    wrapper = fxflops.instrument(model, backward=True, measure_routing=True, strict=True)
    rng = random.Random(5)
    for _ in range(3):
        batch = random_batch(rng)
        wrapper.flops.reset()
        wrapper(**batch).loss.backward()
        assert wrapper.flops.total(convention=ACTUAL) == wrapper.flops.total() > 0
        assert wrapper.program.experts == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def test_grouped_gemm_rows_are_read_on_the_offsets_device():
    """The rows a grouped GEMM computed, 2·K·N·offs[-1]: read on the host for CPU offsets, kept a 0-d
    tensor on any other device (meta here: it has no values, so a host read would raise)."""
    grouped_mm = torch.ops.aten._grouped_mm.default
    x, w = torch.randn(10, 8), torch.randn(3, 8, 4)
    offs = torch.tensor([2, 5, 7], dtype=torch.int32)
    assert dispatched_flops(grouped_mm, (x, w), {"offs": offs}, torch.empty(10, 4)) == 2 * 8 * 4 * 7
    on_device = dispatched_flops(grouped_mm, (x.to("meta"), w.to("meta")), {"offs": offs.to("meta")}, None)
    assert isinstance(on_device, torch.Tensor) and on_device.device.type == "meta" and on_device.dtype == torch.int64
