"""Image crops projected onto the image tokens, counted symbolically (``fxflops/adapters/crops.py``):
Phi-4-multimodal lays out each image's crop features with Python loops over ``image_sizes`` and the
patch mask's values, then projects exactly as many rows as ``input_ids`` holds image tokens (a
derived size, ``capture/derived.py``).

A tiny random-weight model (builder in ``test_hf_measured_families.py``) called on 1-4 images of
1x1, 1x2 or 2x1 crops + a global crop, padded to the batch's most crops, with right or bottom
patches of the resized image off in the mask, each image in a random one of 1-3 right-padded
sequences, text-only calls mixed in. Reference per call: FlopCounterMode on the eager model and
batch (it counts CPU SDPA as 0: an sdpa wrapper is checked against the eager twin), forward per
module, training per top-level module replayed alone and the step's total. Every image call counts
through one program in the image tokens, nothing measured.
"""

from __future__ import annotations


import pytest
import torch

import fxflops
from reference import assert_matmul_count_exact_and_count_all_refused, assert_forward_per_module, assert_measured_without_tokens, assert_symbolic_in, assert_training_call_matches, random_calls, with_attention
from test_hf_measured_families import PHI4_IMAGE, build_phi4_multimodal, phi4_batch

pytest.importorskip("transformers")

CALLS = 10
TEXT_ONLY = (3, 7)
IMAGE_EMBEDDING = "model.embed_tokens_extend.image_embed"
TOP_LEVEL = [IMAGE_EMBEDDING, "model.layers.0", "model.layers.1", "lm_head"]


def calls(model, seed: str, training: bool) -> list[dict]:
    return random_calls(lambda rng, images: phi4_batch(model, rng, images), seed, training, CALLS, TEXT_ONLY)


def image_tokens(batch: dict) -> int:
    """The image tokens the processor's layout gives, image by image (phi4_batch's blocks)."""
    return sum(int(token == PHI4_IMAGE) for row in batch["input_ids"].tolist() for token in row)


def check_symbolic(wrapper) -> None:
    """Image calls through one program in the image tokens; nothing measured or uncounted."""
    assert_symbolic_in(wrapper, "image_tokens")


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.long)])
def test_forward_counts_equal_flop_counter_per_module(attn):
    model = build_phi4_multimodal()
    wrapper = fxflops.instrument(with_attention(model, attn), strict=True)
    assert_forward_per_module(wrapper, model, calls(model, f"phi4-forward-{attn}", training=False), attn)
    check_symbolic(wrapper)
    # make_fx's module-stack tracer calls its own methods on its proxies of the modules, which share
    # their __dict__: not the model's state (taken as such: 200 guards of absent names per call)
    assert not {guard.key for program in wrapper.programs for guard in program.state.guards} & {"get_base", "reset_proxy_mapping"}


@pytest.mark.long  # ~1 min: the default suite keeps its time (CI runs the long suite too)
def test_training_counts_equal_flop_counter_per_top_level_module():
    model = build_phi4_multimodal()
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    wrapper.train()
    for i, batch in enumerate(calls(model, "phi4-training", training=True)):
        paths = TOP_LEVEL if "image_pixel_values" in batch else TOP_LEVEL[1:]
        _, _, forward, training = assert_training_call_matches(wrapper, model, batch, paths, i)
        assert training[""] > 2 * forward[""] > 0
    check_symbolic(wrapper)


def test_the_derived_size_is_the_image_tokens_on_the_host_and_on_a_device():
    """The projection's formula is in T, which the binder counts from input_ids; the same count read
    on the host or with tensor ops (as for a tensor on an accelerator); outputs and inputs unchanged;
    count="all" refused naming what the stand-in leaves out, the matmul count exact."""
    model = build_phi4_multimodal()
    wrapper = fxflops.instrument(model, strict=True)
    batch = calls(model, "phi4-derived", training=False)[0]
    ids = batch["input_ids"].clone()
    with torch.no_grad():
        plain = model(**batch).logits
        counted = wrapper(**batch).logits
    assert torch.equal(plain, counted) and torch.equal(batch["input_ids"], ids)
    program = next(p for p in wrapper.programs if "image_tokens" in p.derived)
    values = dict(zip(map(str, program.all_symbols), program.values(**batch)))
    assert values["image_tokens"] == image_tokens(batch) > 0
    assert "image_tokens" in {str(s) for s in program.formula("model.embed_tokens_extend.image_embed.img_projection_up").free_symbols}
    assert "input_ids" in program.describe_symbols()["image_tokens"]
    assert_matmul_count_exact_and_count_all_refused(wrapper, program, model, batch, "image_tokens")


@pytest.mark.long
def test_crops_without_image_tokens_are_measured_exactly():
    """Crops but no image token: the model skips its image embedding (``if (input_ids ==
    image_token_id).any()``), outside the program (its guard T >= 1): captured again and measured,
    as FlopCounterMode counts it (no vision tower); the next image call counts through the program.
    One image token more than the crops give: the model rejects the call, nothing is added."""
    model = build_phi4_multimodal()
    wrapper = fxflops.instrument(model, strict=True)
    assert_measured_without_tokens(wrapper, model, calls(model, "phi4-no-tokens", training=False)[0], PHI4_IMAGE, IMAGE_EMBEDDING)
