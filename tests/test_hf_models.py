"""Hugging Face VLMs with zero configuration: ``fxflops.instrument(model, backward=True)`` on tiny
random-weight transformers models (``fxflops/models/hf_zoo.py``), over random microbatches.

Reference, per microbatch: FlopCounterMode on the same batch through the same family built with
``attn_implementation="eager"`` (attention as explicit matmuls, which FlopCounterMode counts), once
forward-only and once forward + ``loss.backward()``, total and per top-level module. fxflops' numbers
are its forward phase and its model FLOPs (fwd + bwd phases): with sdpa, the fused backward also
recomputes Q·Kᵀ, which fxflops bills to the recompute phase and eager attention never does.
"""

from __future__ import annotations

import random

import pytest
import torch

import fxflops
from fxflops.models import hf_zoo
from reference import MODEL_FLOPS, assert_training_call_matches, flop_counter_modules

pytest.importorskip("transformers")

BATCHES = 3  # per family (sdpa) in the default suite; the long suite runs LONG_BATCHES, eager and sdpa
LONG_BATCHES = 30


def top_level(model: torch.nn.Module) -> list[str]:
    """The vision tower, projector/merger, language model and head of a VLM: the children of its
    base model, the head, and any merger inside the tower."""
    base = [f"model.{name}" for name, _ in model.model.named_children()]
    mergers = [path for path, _ in model.named_modules() if path.count(".") == 2 and path.endswith("merger")]
    return base + mergers + ["lm_head"]


def media_counts(family: str, rng: random.Random) -> dict[str, int]:
    """Images 1-6; families with video get 1-2 videos in every batch (one call layout, one capture)."""
    return dict(images=rng.randint(1, 6), videos=rng.randint(1, 2) if hf_zoo.FAMILIES[family].videos else 0)


@pytest.fixture(scope="module")
def references():
    return {}


def check_random_microbatches(family: str, attn: str, batches: int, references: dict) -> None:
    """``batches`` random training microbatches of ``family`` (``attn``) against FlopCounterMode per
    top-level module, one capture."""
    if family not in references:
        references[family] = hf_zoo.build(family, "eager")
    reference = references[family]
    wrapper = fxflops.instrument(hf_zoo.build(family, attn), backward=True, strict=True, measure_routing=True)
    modules = top_level(reference)
    rng = random.Random(f"{family}-{attn}")
    for i in range(batches):
        batch = hf_zoo.random_batch(family, rng, **media_counts(family, rng))
        _, got_training, forward, training = assert_training_call_matches(wrapper, reference, batch, modules, (family, attn, i))
        assert training[""] > 2 * forward[""] > 0
        if wrapper.program.experts:  # MoE: the dispatch measured (eager loop, dropless) is the model count
            assert wrapper.flops.breakdown(convention=MODEL_FLOPS.but(moe="actual")) == got_training
    assert wrapper.captures == 1 and wrapper.flops.uncounted == 0
    assert not wrapper.program.unsupported
    assert bool(wrapper.program.experts) == family.endswith("_moe")  # each MoE layer's dispatch found


# Qwen2.5-VL (Qwen2-VL's tower with windows) and Qwen3-VL-MoE (Qwen3-VL's with MoE text layers) run
# in the long suite's many-batch test only, Gemma 3 and LLaVA-SigLIP here in the long suite (the
# default suite counts them exactly in test_hf_situations' mixed batches): it stays within its time.
@pytest.mark.parametrize("family", [
    pytest.param(f, marks=pytest.mark.long) if f in ("gemma3", "llava_siglip") else f
    for f in hf_zoo.FAMILIES if f not in ("qwen2_5_vl", "qwen3_vl_moe")
])
def test_zero_config_counts_equal_flop_counter_per_module(family, references):
    check_random_microbatches(family, "sdpa", BATCHES, references)


@pytest.mark.long
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(hf_zoo.FAMILIES))
def test_zero_config_counts_equal_flop_counter_per_module_on_many_batches(family, attn, references):
    check_random_microbatches(family, attn, LONG_BATCHES, references)


@pytest.fixture(scope="module")
def qwen2_vl():
    model = hf_zoo.build("qwen2_vl", "eager")
    batch = hf_zoo.random_batch("qwen2_vl", random.Random(0), images=2, videos=1)
    return model, batch, fxflops.trace(model, kwargs=batch)


def test_formula_names_the_batch_sizes_and_segment_power_sums(qwen2_vl):
    _, _, program = qwen2_vl
    names = set(map(str, program.symbols))
    assert {"batch", "seq", "patches", "video_patches", "image_cu_seqlens_p2", "video_cu_seqlens_p2"} <= names
    assert not any("grid" in name for name in names)  # the number of images is never a symbol
    vision = program.formula("model.visual")
    assert vision.free_symbols and all("seq" != str(s) for s in vision.free_symbols)


def test_one_capture_serves_one_to_six_images(qwen2_vl):
    model, _, program = qwen2_vl
    rng = random.Random(1)
    for images in (1, 6):
        batch = hf_zoo.random_batch("qwen2_vl", rng, images=images, videos=1)
        assert batch["image_grid_thw"].shape[0] == images
        assert program.count(**batch) == flop_counter_modules(model, batch, backward=False)[""]


def test_malformed_grids_are_errors_naming_the_input(qwen2_vl):
    _, batch, program = qwen2_vl
    taller = dict(batch, image_grid_thw=batch["image_grid_thw"] * torch.tensor([1, 2, 1]))  # not the tokens
    with pytest.raises(fxflops.MetadataError, match="image_grid_thw"):
        program.count(**taller)
    fewer_rows = dict(batch, pixel_values=batch["pixel_values"][:-4])  # the grid covers more patches
    with pytest.raises(fxflops.MetadataError, match="image_grid_thw describes .* but pixel_values has"):
        program.count(**fewer_rows)
    offsets = program.prepare((), batch)[1]["image_cu_seqlens"].clone()
    offsets[-1] += 4  # precomputed offsets that overrun the patches
    with pytest.raises(fxflops.MetadataError, match="image_cu_seqlens"):
        program.count(**batch, image_cu_seqlens=offsets)


def test_vision_metadata_kept_per_grid_is_what_transformers_derives_for_that_grid(qwen2_vl):
    """The adapter keeps the encoder's derived inputs per grid (values, not tensor identity): a grid
    seen before gives the same tensors as transformers' own precomputation, a grid changed in place
    gets its own, and a grid with a different device or dtype is never confused with another."""
    from transformers.exporters.utils import precompute_export_inputs

    model = qwen2_vl[0]
    adapter = fxflops.instrument(model)._adapter
    rng = random.Random(3)
    grids = [hf_zoo.random_batch("qwen2_vl", rng, images=n)["image_grid_thw"] for n in (1, 3, 3, 5)]
    grids.append(grids[1].clone())  # equal values, another tensor: the same metadata
    changed = grids[2].clone()
    grids.append(changed)
    for _ in range(2):
        for grid in grids:
            expected = {"grid_thw": grid}
            precompute_export_inputs(model.model.visual, expected)
            got = adapter._vision_metadata(grid)
            assert set(got) == set(expected) - {"grid_thw"}
            for key, value in got.items():
                assert torch.equal(value, expected[key]) if isinstance(value, torch.Tensor) else value == expected[key], key
        changed[0, 1] += 2  # in place: the next round must derive it again
    assert len(adapter._derived_by_grid) <= len(grids) + 1


def test_a_new_call_layout_is_recaptured_or_refused():
    """A text-only microbatch (no pixels) after image batches: a second program, counted exactly; with
    ``on_miss="raise"`` the call is refused with the missing inputs named."""
    model = hf_zoo.build("qwen2_vl", "eager")
    rng = random.Random(2)
    images = hf_zoo.random_batch("qwen2_vl", rng, images=2)
    text = {k: images[k] for k in ("input_ids", "attention_mask", "labels")}
    text["input_ids"] = text["input_ids"].masked_fill(text["input_ids"] >= hf_zoo.IMAGE, 7)
    wrapper = fxflops.instrument(model)
    with torch.no_grad():
        wrapper(**images)
        wrapper.flops.reset()
        wrapper(**text)
    assert wrapper.captures == 2 and wrapper.flops.total() == flop_counter_modules(model, text, backward=False)[""]
    strict = fxflops.instrument(model, on_miss="raise", strict=True)
    with torch.no_grad():
        strict(**images)
        with pytest.raises(fxflops.FxFlopsError, match="pixel_values"):
            strict(**text)


def test_plain_models_get_no_adapter():
    from fxflops.capture.adapters import Adapter
    from fxflops.adapters import adapter_for
    from fxflops.models.tiny_gpt import GPTConfig, TinyGPT

    assert type(adapter_for(TinyGPT(GPTConfig()))) is Adapter


def test_a_family_whose_image_count_is_data_counts_it_or_is_measured_never_miscounted():
    """SmolVLM keeps the image slots whose pixels are not all zero: the vision tower's batch is data.
    Its adapter counts those frames as a derived size (``adapters/frames.py``): ``fxflops.trace``
    captures it symbolically. A batch whose every slot is zero (SmolVLM then runs its first slot
    anyway) is outside that: a symbolic trace refuses it naming the base model; ``instrument``
    measures the base model's own code and counts the tower, connector and text model by their own
    programs (= FlopCounterMode); ``measure=False`` refuses it."""
    import transformers  # the module already skips without it (never in CI: the test extra has it)
    config = transformers.SmolVLMConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=8),
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512),
        scale_factor=2, image_token_id=250,
    )
    for sub in (config, config.text_config, config.vision_config):
        sub._attn_implementation = "eager"  # attention as matmuls: FlopCounterMode counts CPU SDPA as 0
    model = transformers.SmolVLMForConditionalGeneration(config).eval()
    ids = torch.cat([torch.full((1, 3), 5), torch.full((1, 4), 250), torch.full((1, 4), 6)], 1)
    batch = dict(input_ids=ids, pixel_values=torch.randn(1, 1, 3, 32, 32))
    program = fxflops.trace(model, kwargs=batch)
    assert "image_frames" in program.derived and not program.unsupported
    assert program.count(**batch) == flop_counter_modules(model, batch, backward=False)[""] > 0
    padding = dict(batch, pixel_values=torch.zeros(1, 1, 3, 32, 32))
    with pytest.raises(fxflops.CaptureError, match=r"patch_embedding.*data-dependent.*made in module 'model'"):
        fxflops.trace(model, kwargs=padding)
    refusing = fxflops.instrument(model, measure=False)
    with pytest.warns(UserWarning, match="not counted"), torch.no_grad():
        refusing(**padding)
    assert refusing.flops.uncounted == 1 and refusing.flops.total() == 0
    wrapper = fxflops.instrument(model, strict=True)
    with torch.no_grad():
        wrapper(**padding)
    assert wrapper.flops.total() == flop_counter_modules(model, padding, backward=False)[""] > 0
    assert list(wrapper.measured) == ["model"]  # the base model's own code: the tower, connector, text model symbolic


REPEATS = {  # family -> (vision layer stack, {reused text layer: template}) at 4 + 4 layers
    "qwen2_vl": ("model.visual.blocks", {1: 0, 2: 0, 3: 0}),
    "gemma3": ("model.vision_tower.encoder.layers", {2: 0, 3: 1}),  # sliding, full, sliding, full
    "llava_clip": ("model.vision_tower.encoder.layers", {1: 0, 2: 0, 3: 0}),  # the last: no backward
}


@pytest.mark.parametrize("family", [f if f == "llava_clip" else pytest.param(f, marks=pytest.mark.long) for f in REPEATS])
def test_repeated_layers_are_traced_once_and_counted_exactly(family):
    """4 text and 4 vision layers: repeated layers are billed as copies of a traced one (only layers
    of the same kind: Gemma 3 alternates sliding and full attention), and every layer's forward and
    training FLOPs still equal FlopCounterMode's (LLaVA's last CLIP layer gets no backward)."""
    vision, text_templates = REPEATS[family]
    model = hf_zoo.build(family, "eager", text_layers=4, vision_layers=4)
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    layers = [f"model.language_model.layers.{i}" for i in range(4)] + [f"{vision}.{i}" for i in range(4)]
    rng = random.Random(7)
    for i in range(3):
        batch = hf_zoo.random_batch(family, rng)
        got_forward, _, forward, _ = assert_training_call_matches(wrapper, model, batch, layers + top_level(model), (family, i))
        assert all(path in got_forward and path in forward for path in layers)  # every layer ran and was counted
    assert wrapper.captures == 1
    assert wrapper.program.reused == {
        **{f"model.language_model.layers.{i}": f"model.language_model.layers.{t}" for i, t in text_templates.items()},
        **{f"{vision}.{i}": f"{vision}.0" for i in (1, 2, 3)},
    }
