"""Patch grids cut from padded images by ``image_sizes``, counted symbolically
(``fxflops/adapters/patch_grids.py``): Mistral 3 (Pixtral tower + 2x2 patch merger), LightOnOCR (the
same, with per-image split sizes from a loop over ``image_sizes``: ``adapters/pieces.py``) and LLaVA
with a Pixtral tower, whose transformer runs on N = Σᵢ ⌊hᵢ/p⌋·⌊wᵢ/p⌋ patches that only the values of
``image_sizes`` give (a derived size, ``capture/derived.py``).

Tiny random-weight models called on 1-6 images of random sizes (any pixel size, not only multiples of
the patch: the floors matter), zero padded to the largest, 1-3 right-padded sequences, text-only calls
mixed in; eager and sdpa. Reference per call: FlopCounterMode on the same batch through the eager model
(its CPU SDPA count is 0, so sdpa is never the reference): forward per module, training per top-level
module replayed alone and the step's total. The image calls count through one program in the derived
sizes (a second only where an example has a single patch), nothing measured.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import fxflops
from fxflops.errors import InputError, MetadataError
from reference import assert_count_on_host_and_device, assert_forward_per_module, assert_symbolic_in, assert_training_call_matches, flop_counter_modules, random_calls, with_attention
from test_hf_measured_families import IMAGE, TEXT, eager, owners_of, sequences_with

pytest.importorskip("transformers")

PATCH, MERGE = 8, 2


def pixtral_tower() -> dict:
    return dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_hidden_layers=2, image_size=64, patch_size=PATCH, head_dim=8)


def build_mistral3() -> torch.nn.Module:
    import transformers

    config = transformers.Mistral3Config(
        vision_config=pixtral_tower(), text_config=dict(TEXT, model_type="mistral", head_dim=16, sliding_window=None),
        image_token_index=IMAGE, spatial_merge_size=MERGE, vision_feature_layer=-1)
    return eager(transformers.Mistral3ForConditionalGeneration, config)


def build_llava_pixtral() -> torch.nn.Module:
    import transformers

    config = transformers.LlavaConfig(
        vision_config=pixtral_tower(), text_config=dict(TEXT, model_type="mistral", head_dim=16, sliding_window=None),
        image_token_index=IMAGE, vision_feature_layer=-1, vision_feature_select_strategy="full")
    return eager(transformers.LlavaForConditionalGeneration, config)


def build_lighton_ocr() -> torch.nn.Module:
    import transformers

    config = transformers.LightOnOcrConfig(
        vision_config=pixtral_tower(), text_config=dict(TEXT, model_type="qwen3", head_dim=16, sliding_window=None),
        image_token_id=IMAGE, spatial_merge_size=MERGE)
    return eager(transformers.LightOnOcrForConditionalGeneration, config)


MERGED = ("mistral3", "lighton_ocr")  # the families with a k x k patch merger


def tokens_of(family: str, h: int, w: int) -> int:
    """An image's features in the text, as the processor counts them: its ⌊h/p⌋ x ⌊w/p⌋ patches,
    merged k x k (flooring) by Mistral 3 and LightOnOCR."""
    rows, cols = h // PATCH, w // PATCH
    return (rows // MERGE) * (cols // MERGE) if family in MERGED else rows * cols


def batch_of(family: str, rng: random.Random, images: int) -> dict:
    """``images`` images of random sizes (16-64 px for Mistral 3, whose merger needs 2x2 patches;
    8-64 px for LLaVA), pixel_values (images, 3, max h, max w) zero padded, image_sizes (images, 2)."""
    low = PATCH * (MERGE if family in MERGED else 1)
    sizes = [(rng.randint(low, 64), rng.randint(low, 64)) for _ in range(images)]
    batch = rng.randint(1, 3)
    blocks = [[IMAGE] * tokens_of(family, h, w) for h, w in sizes]
    call = sequences_with(rng, batch, blocks, owners_of(rng, batch, len(sizes)))
    if not sizes:
        return call
    pixels = torch.zeros(len(sizes), 3, max(h for h, _ in sizes), max(w for _, w in sizes))
    for i, (h, w) in enumerate(sizes):
        pixels[i, :, :h, :w] = torch.randn(3, h, w)
    return dict(call, pixel_values=pixels, image_sizes=torch.tensor(sizes))


FAMILIES = {"mistral3": build_mistral3, "llava_pixtral": build_llava_pixtral, "lighton_ocr": build_lighton_ocr}
CALLS = 10
TEXT_ONLY = (3, 7)
TOP_LEVEL = ["model.vision_tower", "model.multi_modal_projector", "model.language_model", "lm_head"]
TOP_LEVEL_OF = {"lighton_ocr": ["model.vision_encoder", "model.vision_projection", "model.language_model", "lm_head"]}


def calls(family: str, seed: str, training: bool) -> list[dict]:
    return random_calls(lambda rng, images: batch_of(family, rng, rng.randint(1, 6) if images else 0), seed, training, CALLS, TEXT_ONLY)


def check_symbolic(wrapper) -> None:
    """Image calls through programs in the derived patch count (one, and one more only for an example
    of a single patch); nothing measured or uncounted."""
    assert_symbolic_in(wrapper, "image_patches", programs=2, captures=3)


@pytest.mark.parametrize(
    ("family", "attn"),
    [("mistral3", "eager"), ("lighton_ocr", "eager"), pytest.param("llava_pixtral", "eager", marks=pytest.mark.long)]
    + [pytest.param(f, "sdpa", marks=pytest.mark.long) for f in FAMILIES],
)
def test_forward_counts_equal_flop_counter_per_module(family, attn):
    reference = FAMILIES[family]()
    wrapper = fxflops.instrument(with_attention(reference, attn), strict=True)
    assert_forward_per_module(wrapper, reference, calls(family, f"{family}-forward", training=False), (family, attn))
    check_symbolic(wrapper)


@pytest.mark.long  # ~30 s each: the default suite keeps its time (CI runs the long suite too)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_counts_equal_flop_counter_per_top_level_module(family, attn):
    reference = FAMILIES[family]()
    wrapper = fxflops.instrument(with_attention(reference, attn), backward=True, strict=True)
    wrapper.train()
    for i, batch in enumerate(calls(family, f"{family}-training", training=True)):
        top = TOP_LEVEL_OF.get(family, TOP_LEVEL)
        paths = top if "pixel_values" in batch else top[2:]
        _, _, forward, training = assert_training_call_matches(wrapper, reference, batch, paths, (family, attn, i))
        assert training[""] > 2 * forward[""] > 0
    check_symbolic(wrapper)


def test_the_derived_sizes_are_the_towers_patches_and_the_mergers_windows():
    """The program's formula is in the patches the tower keeps and the merger's windows, which the
    binder computes from image_sizes as the model does (floors included); the padded batch only sizes
    the patch convolution. The same count with image_sizes read on the host or with tensor ops (as
    for a tensor on an accelerator)."""
    model = build_mistral3()
    wrapper = fxflops.instrument(model, strict=True)
    batch = batch_of("mistral3", random.Random(11), 4)
    del batch["labels"]
    with torch.no_grad():
        wrapper(**batch)
    program = next(p for p in wrapper.programs if "image_patches" in p.derived)
    sizes = batch["image_sizes"].tolist()
    patches = sum((h // PATCH) * (w // PATCH) for h, w in sizes)
    windows = sum((h // PATCH // MERGE) * (w // PATCH // MERGE) for h, w in sizes)
    values = dict(zip(map(str, program.all_symbols), program.values(**batch)))
    assert (values["image_patches"], values["merged_image_patches"]) == (patches, windows)
    assert {"image_patches", "merged_image_patches"} <= set(map(str, program.formula("model.vision_tower").free_symbols)) | {
        str(s) for s in program.formula("model.multi_modal_projector").free_symbols}
    assert "image_sizes" in program.describe_symbols()["image_patches"]
    assert_count_on_host_and_device(program, batch, flop_counter_modules(model, batch, backward=False)[""])


def test_the_model_computes_what_it_computes_alone():
    """Counting changes nothing the model returns, nor the user's tensors."""
    model = build_mistral3()
    batch = batch_of("mistral3", random.Random(3), 3)
    del batch["labels"]
    sizes, pixels = batch["image_sizes"].clone(), batch["pixel_values"].clone()
    with torch.no_grad():
        plain = model(**batch).logits
        counted = fxflops.instrument(model, strict=True)(**batch).logits
    assert torch.equal(plain, counted)
    assert torch.equal(batch["image_sizes"], sizes) and torch.equal(batch["pixel_values"], pixels)


def _runs(wrapper, call: dict) -> Exception | None:
    """Call ``wrapper``; the exception it raised, if any (None when the call returned)."""
    try:
        with torch.no_grad():
            wrapper(**call)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def test_malformed_image_sizes_are_named_never_counted():
    """image_sizes with a negative size, three columns, floats or another number of images than
    pixel_values: never a count. fxflops refuses it naming image_sizes (strict: an error; else a
    warning) unless the model's own code rejects the call first."""
    model = build_mistral3()
    batch = batch_of("mistral3", random.Random(5), 2)
    del batch["labels"]
    strict = fxflops.instrument(model, strict=True)
    lenient = fxflops.instrument(model)
    for wrapper in (strict, lenient):
        assert _runs(wrapper, batch) is None  # the program exists: the bad calls below meet it first
    sizes = batch["image_sizes"]
    bad = {
        "negative": sizes * torch.tensor([[-1, 1], [1, 1]]),
        "three columns": torch.cat([sizes, sizes[:, :1]], dim=1),
        "floats": sizes.float(),
        "other images": torch.cat([sizes, sizes[:1]]),
    }
    for label, image_sizes in bad.items():
        call = dict(batch, image_sizes=image_sizes)
        strict.flops.reset()
        raised = _runs(strict, call)
        assert raised is not None, label
        if isinstance(raised, (MetadataError, InputError)):
            assert "image_sizes" in str(raised), (label, raised)
        else:
            assert "fxflops" not in type(raised).__module__, (label, raised)
        assert strict.flops.total() == 0, label
        lenient.flops.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            raised = _runs(lenient, call)
        assert raised is None or "fxflops" not in type(raised).__module__, (label, raised)
        if raised is None:  # the model ran it: fxflops said why it did not count it
            assert any("image_sizes" in str(w.message) for w in caught), label
        assert lenient.flops.total() == 0, label
