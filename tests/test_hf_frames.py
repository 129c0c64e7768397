"""Padding frames dropped by their pixel values, counted symbolically (``fxflops/adapters/frames.py``):
Idefics2, Idefics3 and SmolVLM run their vision tower and connector on the R frames of
``pixel_values`` that are not all zero, a size only the pixel values give (a derived size,
``capture/derived.py``).

Tiny random-weight models (builders in ``test_hf_measured_families.py``) called on 1-6 frames in all
(Idefics3 / SmolVLM: images split into 1x2 / 2x1 tiles + a global frame, or a global frame alone;
Idefics2: one frame per image, its connector a perceiver resampler; a frame of a non-square image
partly padded), each in a random one of 1-3 right-padded sequences, all-zero padding frames up to
the batch's most, text-only calls mixed in; eager and sdpa attention (FlopCounterMode counts CPU
SDPA as 0: an sdpa wrapper is checked against its eager twin). Reference per call: FlopCounterMode
on the same batch through the eager model: forward per module, training per top-level module
replayed alone and the step's total. Every image call counts through one program in R, nothing
measured; a call whose frames are all padding is measured.
"""

from __future__ import annotations

import random

import pytest
import torch

import fxflops
from reference import assert_count_on_host_and_device, assert_forward_per_module, assert_symbolic_in, assert_training_call_matches, flop_counter_modules, random_calls, with_attention
from test_hf_measured_families import FRAME_TOKENS, IMAGE, build_idefics2, build_idefics3, build_smolvlm, idefics2_batch, idefics3_batch

pytest.importorskip("transformers")

FAMILIES = {  # family -> (build, batch(model, rng, images))
    "idefics3": (build_idefics3, idefics3_batch),
    "smolvlm": (build_smolvlm, idefics3_batch),
    "idefics2": (build_idefics2, idefics2_batch),
}
CALLS = 10
TEXT_ONLY = (3, 7)
TOP_LEVEL = ["model.vision_model", "model.connector", "model.text_model", "lm_head"]


def calls(family: str, model, seed: str, training: bool) -> list[dict]:
    make_batch = FAMILIES[family][1]
    return random_calls(lambda rng, images: make_batch(model, rng, images), seed, training, CALLS, TEXT_ONLY)


def real_frames(pixel_values: torch.Tensor) -> int:
    """The frames the model keeps, counted one by one: those with any non-zero pixel."""
    return sum(1 for frame in pixel_values.flatten(0, 1) if bool((frame != 0).any()))


def check_symbolic(wrapper) -> None:
    """Image calls through one program in the derived frame count; nothing measured or uncounted."""
    assert_symbolic_in(wrapper, "image_frames")


@pytest.mark.parametrize(
    "family,attn",
    [("idefics3", "eager")] + [pytest.param(f, "eager", marks=pytest.mark.long) for f in ("smolvlm", "idefics2")]
    + [pytest.param(f, "sdpa", marks=pytest.mark.long) for f in FAMILIES],
)
def test_forward_counts_equal_flop_counter_per_module(family, attn):
    model = FAMILIES[family][0]()
    wrapper = fxflops.instrument(with_attention(model, attn), strict=True)
    assert_forward_per_module(wrapper, model, calls(family, model, f"{family}-forward", training=False), (family, attn))
    check_symbolic(wrapper)


@pytest.mark.long  # ~1 min each: the default suite keeps its time (CI runs the long suite too)
@pytest.mark.parametrize("family,attn", [(f, "eager") for f in FAMILIES] + [("idefics2", "sdpa")])
def test_training_counts_equal_flop_counter_per_top_level_module(family, attn):
    model = FAMILIES[family][0]()
    wrapper = fxflops.instrument(with_attention(model, attn), backward=True, strict=True)
    wrapper.train()
    for i, batch in enumerate(calls(family, model, f"{family}-training", training=True)):
        paths = TOP_LEVEL if "pixel_values" in batch else TOP_LEVEL[2:]
        _, _, forward, training = assert_training_call_matches(wrapper, model, batch, paths, (family, i))
        assert training[""] > 2 * forward[""] > 0
    check_symbolic(wrapper)


def test_the_derived_size_is_the_real_frames_on_the_host_and_on_a_device():
    """The program's vision formula is in R, which the binder counts from pixel_values as the model
    selects (a padded batch of frames sizes nothing but the padding); the same count read on the
    host or with tensor ops (as for a tensor on an accelerator); outputs and inputs unchanged."""
    model = build_idefics3()
    wrapper = fxflops.instrument(model, strict=True)
    rng = random.Random(11)
    batch = next(b for b in (idefics3_batch(model, rng, True) for _ in range(50)) if real_frames(b["pixel_values"]) < b["pixel_values"].shape[0] * b["pixel_values"].shape[1])
    del batch["labels"]
    pixels = batch["pixel_values"].clone()
    with torch.no_grad():
        plain = model(**batch).logits
        counted = wrapper(**batch).logits
    assert torch.equal(plain, counted) and torch.equal(batch["pixel_values"], pixels)
    program = next(p for p in wrapper.programs if "image_frames" in p.derived)
    values = dict(zip(map(str, program.all_symbols), program.values(**batch)))
    assert values["image_frames"] == real_frames(batch["pixel_values"]) == (batch["input_ids"] == IMAGE).sum() // FRAME_TOKENS
    assert "image_frames" in {str(s) for s in program.formula("model.vision_model").free_symbols}
    assert "pixel_values" in program.describe_symbols()["image_frames"]
    assert_count_on_host_and_device(program, batch, flop_counter_modules(model, batch, backward=False)[""])


def test_a_call_whose_frames_are_all_padding_is_measured_exactly():
    """SmolVLM runs its first frame when every frame is zero (Idefics3 would run none, and then fails
    itself): outside the program (its guard R >= 1), such a call is captured again and measured, and
    counts what FlopCounterMode counts; the next real call counts through the program again."""
    model = build_smolvlm()
    wrapper = fxflops.instrument(model, strict=True)
    rng = random.Random(4)
    batch = idefics3_batch(model, rng, True)
    del batch["labels"]
    with torch.no_grad():
        wrapper(**batch)
    zero = dict(batch, pixel_values=torch.zeros_like(batch["pixel_values"][:, :1]),
                pixel_attention_mask=batch["pixel_attention_mask"][:, :1])
    ids = zero["input_ids"].clone()
    ids[ids == IMAGE] = 0
    ids[0, :FRAME_TOKENS] = IMAGE  # one frame's tokens: what the model's fallback frame fills
    zero["input_ids"] = ids
    for call in (zero, batch):
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(**call)
        assert wrapper.flops.total() == flop_counter_modules(model, call, backward=False)[""] > 0
    assert set(wrapper.measured) == {"model"}
