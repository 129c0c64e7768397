"""Audio clips projected onto the audio tokens, counted symbolically (``fxflops/adapters/audio.py``):
Phi-4-multimodal runs its conformer encoder and projections on every padded frame of every clip
(a numpy streaming mask, a per-clip selection by ``audio_embed_sizes`` and an ``index_put`` to the
audio tokens in between), inside ``if (input_ids == audio_token_id).any():``.

A tiny random-weight model (builder in ``test_hf_measured_families.py``) called on 1-3 clips of 20-70
feature frames padded to the longest, each clip's audio tokens in a random one of 1-3 right-padded
sequences, every other call with 1-4 images too (the vision-speech projection then), text-only calls
mixed in. Reference per call: FlopCounterMode on the same eager model and batch, forward per module,
training per top-level module replayed alone and the step's total (with the encoder's depthwise
convolutions as per-group convolutions: FlopCounterMode bills a grouped weight gradient x groups).
Nothing is measured.
"""

from __future__ import annotations

import pytest
import torch

import fxflops
from reference import (
    assert_matmul_count_exact_and_count_all_refused, assert_forward_per_module, assert_measured_without_tokens, assert_training_call_matches, degrouped,
    random_calls, with_attention,
)
from test_hf_measured_families import PHI4_AUDIO, build_phi4_multimodal, phi4_audio_batch

pytest.importorskip("transformers")

CALLS = 10
TEXT_ONLY = (3, 7)
AUDIO_EMBEDDING = "model.embed_tokens_extend.audio_embed"
IMAGE_EMBEDDING = "model.embed_tokens_extend.image_embed"


def calls(model, seed: str, training: bool) -> list[dict]:
    return random_calls(lambda rng, audio: phi4_audio_batch(model, rng, audio), seed, training, CALLS, TEXT_ONLY)


def audio_tokens(batch: dict) -> int:
    return int((batch["input_ids"] == PHI4_AUDIO).sum())


def check_symbolic(wrapper) -> None:
    """Every call counted by a program, nothing measured, uncounted or unsupported. Programs: audio,
    audio + images, text-only; each at most once more, when a later call's first real run of the
    vision tower installs transformers' output-capturing hooks there (a structure change)."""
    assert wrapper.measured == {} and wrapper.flops.uncounted == 0
    assert not any(p.unsupported for p in wrapper.programs)
    audio = [p for p in wrapper.programs if "audio_tokens" in map(str, p.all_symbols)]
    assert 1 <= len(audio) <= 4 and wrapper.captures <= 6, [p.symbols for p in wrapper.programs]
    assert all({"clips", "audio_frames"} <= set(map(str, p.symbols)) for p in audio)


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.long)])
def test_forward_counts_equal_flop_counter_per_module(attn):
    model = build_phi4_multimodal()
    wrapper = fxflops.instrument(with_attention(model, attn), strict=True)
    batches = calls(model, f"phi4-audio-forward-{attn}", training=False)
    assert any("image_pixel_values" in b for b in batches) and sum("audio_input_features" in b for b in batches) >= 6
    assert_forward_per_module(wrapper, model, batches, attn)
    check_symbolic(wrapper)


@pytest.mark.long  # ~1 min: the default suite keeps its time (CI runs the long suite too)
def test_training_counts_equal_flop_counter_per_top_level_module():
    model = build_phi4_multimodal()
    reference = degrouped(model)  # FlopCounterMode bills a grouped (depthwise) convolution's weight gradient x groups
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    wrapper.train()  # the encoder's streaming mask is random in training: a mask, no counted work
    for i, batch in enumerate(calls(model, "phi4-audio-training", training=True)):
        paths = ["model.layers.0", "model.layers.1", "lm_head"]
        paths += [AUDIO_EMBEDDING] if "audio_input_features" in batch else []
        paths += [IMAGE_EMBEDDING] if "image_pixel_values" in batch else []
        _, _, forward, training = assert_training_call_matches(wrapper, reference, batch, paths, i)
        assert training[""] > 2 * forward[""] > 0
    check_symbolic(wrapper)


def test_the_derived_size_is_the_audio_tokens_on_the_host_and_on_a_device():
    """The encoder's formula is in the clips and their padded frames, the guard of its branch in the
    audio tokens, which the binder counts from input_ids (on the host, and with tensor ops as for an
    accelerator); outputs and inputs unchanged; count="all" refused naming what the stand-ins leave
    out, the matmul count exact."""
    model = build_phi4_multimodal()
    wrapper = fxflops.instrument(model, strict=True)
    batch = calls(model, "phi4-audio-derived", training=False)[0]
    ids, features = batch["input_ids"].clone(), batch["audio_input_features"].clone()
    with torch.no_grad():
        plain = model(**batch).logits
        counted = wrapper(**batch).logits
    assert torch.equal(plain, counted) and torch.equal(batch["input_ids"], ids) and torch.equal(batch["audio_input_features"], features)
    program = next(p for p in wrapper.programs if "audio_tokens" in p.derived)
    values = dict(zip(map(str, program.all_symbols), program.values(**batch)))
    assert values["audio_tokens"] == audio_tokens(batch) > 0
    assert values["audio_frames"] == batch["audio_input_features"].shape[1]
    encoder = {str(s) for s in program.formula(f"{AUDIO_EMBEDDING}.encoder").free_symbols}
    assert "audio_frames" in encoder and "audio_tokens" not in encoder
    assert_matmul_count_exact_and_count_all_refused(wrapper, program, model, batch, "audio_tokens")


@pytest.mark.long
def test_audio_without_audio_tokens_is_measured_exactly():
    """Audio features but no audio token: the model skips its audio embedding, outside the program (its
    guard: at least one audio token): captured again and measured, as FlopCounterMode counts it (no
    encoder); the next audio call counts through the program. One audio token more than the clips give:
    the model rejects the call, nothing is added."""
    model = build_phi4_multimodal()
    wrapper = fxflops.instrument(model, strict=True)
    batch = next(b for b in calls(model, "phi4-audio-no-tokens", training=False) if "audio_input_features" in b and "image_pixel_values" not in b)
    assert_measured_without_tokens(wrapper, model, batch, PHI4_AUDIO, AUDIO_EMBEDDING)
