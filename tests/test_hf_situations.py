"""Hugging Face VLMs: every call counted with the program of its own situation (issue 13).

- Mixed microbatches in any order — text-only, images, videos, images + videos — on every family of
  the zoo: each call equals FlopCounterMode on the same call (the old failure: a text-only first
  batch made later image batches drop the vision tower, 8.0 M counted instead of 14.1 M).
- Changes between calls on Qwen2-VL and LLaVA (train/eval, a frozen vision tower, gradient
  checkpointing on and off in both of torch's forms, ``logits_to_keep``, ``attention_mask`` given or
  not, grad mode), over sequences of calls, forward and training, against FlopCounterMode.

Reference: FlopCounterMode on the same model and call, CPU attention counted (``reference.py``); its
total is exact (only its per-module backward attribution is not, and totals are compared here).
"""

from __future__ import annotations

import random

import pytest
import torch

import fxflops
from fxflops.models import hf_zoo
from reference import flop_counter_with_cpu_attention

transformers = pytest.importorskip("transformers")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


def flop_counter_total(model, batch: dict, backward: bool) -> int:
    """FlopCounterMode's FLOPs of ``model(**batch)`` as called (+ ``loss.backward()``)."""
    with flop_counter_with_cpu_attention(), FlopCounterMode(display=False) as counter:
        out = model(**batch)
        if backward:
            out.loss.backward()
    return counter.get_total_flops()


def counted(wrapper, batch: dict, backward: bool) -> int:
    wrapper.flops.reset()
    out = wrapper(**batch)
    if backward:
        out.loss.backward()
    assert wrapper.flops.uncounted == 0
    return wrapper.flops.total()


def text_only(batch: dict) -> dict:
    """The batch's text with every image or video token replaced by an ordinary one."""
    ids = batch["input_ids"].masked_fill(batch["input_ids"] >= hf_zoo.IMAGE, 7)
    kept = {k: v for k, v in batch.items() if k in ("attention_mask", "labels")}
    return {"input_ids": ids, **kept, **({"token_type_ids": torch.zeros_like(ids)} if "token_type_ids" in batch else {})}


def kinds_for(family: str) -> list[str]:
    return ["text", "images", "images+videos", "videos", "text", "images"] if hf_zoo.FAMILIES[family].videos else ["text", "images", "text", "images"]


def batch_of(family: str, kind: str, rng: random.Random) -> dict:
    if kind == "text":
        return text_only(hf_zoo.random_batch(family, rng, images=1))
    return hf_zoo.random_batch(family, rng, images=0 if kind == "videos" else rng.randint(1, 3), videos=rng.randint(1, 2) if "videos" in kind else 0)


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.long) if f in ("qwen3_vl_moe", "qwen2_5_vl", "qwen3_vl") else f for f in hf_zoo.FAMILIES]
)
def test_mixed_batches_in_any_order_count_exactly(family):
    model = hf_zoo.build(family, "sdpa")
    wrapper = fxflops.instrument(model, strict=True)
    rng = random.Random(family)
    kinds = kinds_for(family)
    rng.shuffle(kinds)
    with torch.no_grad():
        for again in (False, True):
            for kind in kinds:
                batch = batch_of(family, kind, rng)
                assert counted(wrapper, batch, False) == flop_counter_total(model, batch, False), (family, kind)
            if not again:
                # a program per kind of batch; Qwen's text batches may take one more once the model's
                # cached rope_deltas (which its forward reads) went from None to a tensor
                first = wrapper.captures
                assert len(set(kinds)) <= first <= len(set(kinds)) + 1
    assert wrapper.captures == first  # every later batch finds its program


def _vision(model):
    base = model.model
    return getattr(base, "visual", None) or getattr(base, "vision_tower")


@pytest.mark.parametrize(
    ("family", "steps"),
    [("qwen2_vl", 6), pytest.param("qwen2_vl", 12, marks=pytest.mark.long), pytest.param("llava_clip", 12, marks=pytest.mark.long)],
)
def test_changes_between_calls_count_exactly(family, steps):
    torch.manual_seed(0)
    model = hf_zoo.build(family, "sdpa").train()
    wrapper = fxflops.instrument(model, backward=True, strict=True, max_programs=32)
    rng = random.Random(family)
    vision = _vision(model)

    def freeze_vision():
        vision.requires_grad_(not next(vision.parameters()).requires_grad)

    def checkpointing():
        if model.is_gradient_checkpointing:
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": rng.random() < 0.5})

    def train_eval():
        model.train(not model.training)

    changes = [freeze_vision, checkpointing, train_eval]
    calls = 0
    for step in range(steps):
        if step:
            rng.choice(changes)()
        batch = hf_zoo.random_batch(family, rng, images=rng.randint(1, 3))
        if rng.random() < 0.3:
            batch.pop("attention_mask")
        if rng.random() < 0.3:  # an inference call keeping only the last position's logits
            batch = {k: v for k, v in batch.items() if k != "labels"} | {"logits_to_keep": 1}
            with torch.no_grad():
                assert counted(wrapper, batch, False) == flop_counter_total(model, batch, False), (family, step)
        else:
            assert counted(wrapper, batch, True) == flop_counter_total(model, batch, True), (family, step)
        calls += 1
    assert calls == steps and wrapper.captures > 1


def test_the_wrapper_keeps_qwen2_vl_outputs_in_a_manual_decode_loop():
    """The adapter derives M-RoPE positions for image calls as the model does, storing the
    ``rope_deltas`` the model keeps: a manual prefill then decode step gives the plain model's
    logits, and a decode step continuing from the stored deltas is left to the model."""
    from transformers import DynamicCache

    model = hf_zoo.build("qwen2_vl", "eager").eval()
    wrapper = fxflops.instrument(model)
    ids = torch.tensor([[5, 5, hf_zoo.START] + [hf_zoo.IMAGE] * 16 + [hf_zoo.END, 6, 7]])
    vision = model.config.vision_config
    torch.manual_seed(0)
    prefill = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == hf_zoo.IMAGE).long(),
        image_grid_thw=torch.tensor([[1, 8, 8]]),
        pixel_values=torch.randn(64, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2),
    )

    def run(forward):
        model.model.rope_deltas = None
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            first = forward(**prefill, cache=cache, use_cache=True)
            step = dict(input_ids=first.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            second = forward(**step, image_grid_thw=prefill["image_grid_thw"], mm_token_type_ids=torch.zeros_like(step["input_ids"]))
        return first.logits, second.logits, model.model.rope_deltas

    plain, wrapped = run(model), run(wrapper)
    assert torch.equal(plain[2], wrapped[2])  # the deltas the model keeps
    assert torch.allclose(plain[0], wrapped[0]) and torch.allclose(plain[1], wrapped[1])
    assert wrapper.flops.uncounted == 0


def test_a_vision_setting_changed_between_calls_derives_its_metadata_again():
    """Qwen2.5-VL's window offsets depend on the encoder's ``window_size``: the adapter's per-grid
    metadata is kept per setting too, so counts and outputs follow the change."""
    model = hf_zoo.build("qwen2_5_vl", "eager").eval()
    wrapper = fxflops.instrument(model)
    rng = random.Random(5)
    batch = hf_zoo.random_batch("qwen2_5_vl", rng, images=2)
    encoder = model.model.visual
    original = encoder.window_size
    for window in (original, original * 2, original // 2, original):
        encoder.window_size = window
        with torch.no_grad():
            assert counted(wrapper, batch, False) == flop_counter_total(model, batch, False), window
            assert torch.allclose(wrapper(**batch).logits, model(**batch).logits), window


@pytest.mark.parametrize("where", ["model.visual", ""])
def test_accelerate_hooks_on_a_module_trace_that_module(where):
    """accelerate's hooks (what ``device_map`` and offloading install) replace a module's forward by
    ``partial(new_forward, module)``: the capture's twin runs the partial over its own copy of the
    module, so the per-image attention stand-ins apply (the real module kept in the partial made
    multi-image calls count attention over all images' patches at once)."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = hf_zoo.build("qwen2_vl", "eager")
    hooks.add_hook_to_module(model.get_submodule(where), hooks.ModelHook())
    wrapper = fxflops.instrument(model, backward=True)
    rng = random.Random(11)
    for images in (3, 1, 5):
        batch = hf_zoo.random_batch("qwen2_vl", rng, images=images)
        assert counted(wrapper, batch, True) == flop_counter_total(model, batch, True), (where, images)


def test_a_loss_from_the_logits_of_a_sliding_window_model_in_training_is_counted():
    """Mistral (a sliding window: its cache keeps a slice of the keys) in train mode with its cache
    on, no labels, a loss computed from the logits: the cache is no root of the traced backward, so
    the backward that never differentiates it is the whole traced one (was refused as partial)."""
    import torch.nn.functional as F
    import transformers

    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 12))

    def step(f):  # noqa: ANN001, ANN202
        logits = f(input_ids=ids, use_cache=True).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()

    wrapper = fxflops.instrument(model, backward=True)
    for _ in range(2):
        wrapper.flops.reset()
        step(wrapper)
    with FlopCounterMode(display=False) as counter:
        step(model)
    assert wrapper.flops.uncounted == 0
    assert wrapper.flops.total() == counter.get_total_flops()
