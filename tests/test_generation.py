"""generate() counted exactly (issue 18): every forward transformers' ``generate`` makes goes through
the wrapper's counting path, the prompt's as phase ``prefill`` and each later step's as ``decode``.

References are FlopCounterMode (CPU attention counted) on the same ``generate`` call of the plain
model: the whole call, and the call with ``max_new_tokens=1`` (its prefill alone). The key-value
cache's length is a symbol: one prefill and one decode program per call situation serve every step.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from reference import flop_counter_with_cpu_attention

transformers = pytest.importorskip("transformers")

TEXT = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
)


def _text_model(family: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(**TEXT, attn_implementation=attn)
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.Qwen2Config(**TEXT, attn_implementation=attn)
    return transformers.Qwen2ForCausalLM(config).eval()


def _prompt(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TEXT["vocab_size"], (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch):  # left padding on every row but the first
        mask[row, : row + 1] = 0
        ids[row, : row + 1] = TEXT["pad_token_id"]
    return {"input_ids": ids, "attention_mask": mask}


def _reference(model: torch.nn.Module, prompt: dict, **generation) -> int:
    with flop_counter_with_cpu_attention(), FlopCounterMode(display=False) as counter:
        model.generate(**prompt, **generation)
    return counter.get_total_flops()


def _phases(meter: fxflops.Meter) -> tuple[int, int]:
    return meter.total(phase="prefill"), meter.total(phase="decode")


@pytest.mark.parametrize(
    ("family", "attn"),
    [("llama", "eager"), ("qwen2", "sdpa"), *(pytest.param(*c, marks=pytest.mark.long) for c in (("llama", "sdpa"), ("qwen2", "eager")))],
)
def test_generate_counts_prefill_and_every_decode_step_exactly(family, attn):
    model = _text_model(family, attn)
    wrapper = fxflops.instrument(model, strict=True)
    cases = [(1, 7, 4), (3, 5, 6), (1, 11, 1), (3, 9, 16), (1, 4, 9)]  # batch, prompt length, new tokens
    for i, (batch, length, new) in enumerate(cases):
        prompt = _prompt(batch, length, seed=i)
        generation = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        before = _phases(wrapper.flops)
        out = wrapper.generate(**prompt, **generation)
        prefill, decode = (now - then for now, then in zip(_phases(wrapper.flops), before))
        assert torch.equal(out, model.generate(**prompt, **generation)), (batch, length, new)  # nothing changed
        expected_prefill = _reference(model, prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        assert prefill == expected_prefill, (family, attn, batch, length, new)
        assert prefill + decode == _reference(model, prompt, **generation), (family, attn, batch, length, new)
    assert wrapper.flops.generated_tokens == sum(batch * new for batch, _, new in cases)
    assert wrapper.flops.total(phase="fwd") == 0 and wrapper.flops.uncounted == 0
    assert wrapper.captures <= 4  # prefill and decode, with and without a mask: not one per step


def test_sampling_gives_the_same_sequences_and_the_exact_count():
    model = _text_model("llama", "sdpa")
    wrapper = fxflops.instrument(model, strict=True)
    prompt = _prompt(3, 6, seed=7)
    generation = dict(max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(3)
    out = wrapper.generate(**prompt, **generation)
    torch.manual_seed(3)
    assert torch.equal(out, model.generate(**prompt, **generation))
    torch.manual_seed(3)
    assert sum(_phases(wrapper.flops)) == _reference(model, prompt, **generation)


def test_training_and_generation_are_counted_apart():
    from reference import flop_counter_call

    model = _text_model("qwen2", "sdpa").train()
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    batch = _prompt(2, 10, seed=1)
    wrapper(**batch, labels=batch["input_ids"]).loss.backward()
    training = flop_counter_call(model, (), dict(batch, labels=batch["input_ids"]), backward=True)
    assert wrapper.flops.total() == training
    model.eval()
    prompt = _prompt(1, 5, seed=2)
    wrapper.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    generation = sum(_phases(wrapper.flops))
    assert generation == _reference(model, prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert wrapper.flops.total() - generation == training  # the training phases, untouched by generate
    recompute = wrapper.flops.total(phase="recompute")  # SDPA's backward recomputes the scores
    report = wrapper.flops.report(elapsed_s=2.0, peak_flops=1e12)
    assert report.generated_tokens == 5
    assert report.flops_per_generated_token == generation / 5
    assert report.model_flops == training - recompute + generation and report.hardware_flops == training + generation
    assert "tokens generated" in str(report)


def test_generate_leaves_the_model_as_it_was_and_other_threads_uncounted():
    model = _text_model("llama", "eager")
    wrapper = fxflops.instrument(model, strict=True)
    prompt = _prompt(1, 6, seed=4)
    forward = model.forward
    seen: list[int] = []
    started, stop = threading.Event(), threading.Event()

    def other_thread() -> None:
        while not stop.is_set():
            with torch.no_grad():
                model(**_prompt(1, 3, seed=5))
            started.set()

    wrapper.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)  # the captures, first
    worker = threading.Thread(target=other_thread)
    worker.start()
    started.wait(30)
    try:
        for _ in range(2):
            before = wrapper.flops.calls
            wrapper.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
            seen.append(wrapper.flops.calls - before)
    finally:
        stop.set()
        worker.join()
    assert seen == [6, 6]  # the prefill and 5 decode steps each time, none of the other thread's calls
    assert wrapper.captures == 2
    assert "forward" not in vars(model) and "_prefill" not in vars(model) and model.forward == forward
    with pytest.raises(RuntimeError, match="boom"):  # a failing generate leaves the model as it was too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapper.generate(**prompt, max_new_tokens=2, stopping_criteria=[_raise_boom])
    assert "forward" not in vars(model)


def _raise_boom(input_ids, scores, **kwargs):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    "family",
    ["qwen2_vl", *(pytest.param(f, marks=pytest.mark.long) for f in ("gemma3", "llava_clip", "qwen2_5_vl", "qwen3_vl"))],
)
def test_generate_with_images_counts_the_vision_tower_in_the_prefill(family):
    """transformers encodes images before the prefill, outside the forward, once per image (the
    features expanded for beams and returned sequences, kept for the steps of a generation without
    cache): fxflops measures that encoding as the prefill's work and leaves it where the model does
    it (was: the encoding moved into the forward, which re-encoded images per beam and per step:
    other sequences, and work the model does not do). Gemma 3: sliding-window cache layers, whose
    window the 12 new tokens pass."""
    import random

    from fxflops.models import hf_zoo

    model = hf_zoo.build(family, "eager").eval()
    wrapper = fxflops.instrument(model, strict=True)
    rng = random.Random(0)
    greedy, short = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False), dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    for images, generation in [
        (1, greedy), (2, greedy), (1, dict(short, num_beams=2, num_return_sequences=2)), (1, dict(short, use_cache=False)),
    ]:
        batch = hf_zoo.random_batch(family, rng, images=images, batch=1)
        batch.pop("labels", None)
        before = sum(_phases(wrapper.flops))
        out = wrapper.generate(**batch, **generation)
        assert torch.equal(out, model.generate(**batch, **generation)), (family, images, generation)
        assert sum(_phases(wrapper.flops)) - before == _reference(model, batch, **generation), (family, images, generation)
    assert wrapper.flops.uncounted == 0


def test_an_encoder_decoder_generate_is_refused_not_counted_without_its_encoder():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    wrapper = fxflops.instrument(model)
    ids = torch.randint(1, 64, (1, 5))
    with pytest.warns(UserWarning, match="encoder-decoder"):
        out = wrapper.generate(input_ids=ids, max_new_tokens=3)
    assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=3))
    assert wrapper.flops.uncounted == 1 and wrapper.flops.calls == 0
    with pytest.raises(fxflops.errors.CaptureError, match="encoder-decoder"):
        fxflops.instrument(model, strict=True).generate(input_ids=ids, max_new_tokens=3)


def test_two_threads_generating_through_one_wrapper_both_count_exactly():
    model = _text_model("llama", "eager")
    wrapper = fxflops.instrument(model, strict=True)
    prompts = [_prompt(1, 6, seed=8), _prompt(3, 4, seed=9)]
    generation = dict(max_new_tokens=7, min_new_tokens=7, do_sample=False)
    for prompt in prompts:  # the captures first: then both threads only count
        wrapper.generate(**prompt, **generation)
    wrapper.flops.reset()
    barrier, errors = threading.Barrier(2), []

    def generate(prompt) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                wrapper.generate(**prompt, **generation)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=generate, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expected = 3 * sum(_reference(model, prompt, **generation) for prompt in prompts)
    assert sum(_phases(wrapper.flops)) == expected and wrapper.flops.calls == 2 * 3 * 7
    assert "forward" not in vars(model)


def test_a_hand_written_decode_loop_through_the_wrapper_counts_exactly_with_two_programs():
    """A KV cache passed to the wrapper by hand: real logits and cache contents, the cache length a
    symbol (one program for the prompt, one for every decode step)."""
    model = _text_model("qwen2", "eager")
    wrapper = fxflops.instrument(model, strict=True)

    def decode(module, prompt, steps):
        cache = transformers.DynamicCache(config=model.config)
        logits = []
        with torch.no_grad():
            out = module(input_ids=prompt, past_key_values=cache, use_cache=True)
            for _ in range(steps):
                logits.append(out.logits[:, -1])
                out = module(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        return torch.stack(logits), cache

    for length, steps in ((5, 3), (9, 12)):
        prompt = _prompt(2, length, seed=length)["input_ids"]
        before = wrapper.flops.total()
        logits, cache = decode(wrapper, prompt, steps)
        expected_logits, expected_cache = decode(model, prompt, steps)
        assert torch.equal(logits, expected_logits)
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, expected_cache.layers))
        with flop_counter_with_cpu_attention(), FlopCounterMode(display=False) as counter:
            decode(model, prompt, steps)
        assert wrapper.flops.total() - before == counter.get_total_flops(), (length, steps)
    assert wrapper.captures == 2


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.long)])
def test_a_static_cache_generate_counts_every_step_against_the_whole_cache(attn):
    """A static cache preallocates ``max_cache_len`` positions and every step attends over all of
    them (masked): its length is the layer's ``max_cache_len``, a symbol, so one prefill and one
    decode program serve requests of every length."""
    model = _text_model("llama", attn)
    wrapper = fxflops.instrument(model, strict=True)
    for i, (batch, length, new) in enumerate([(1, 7, 4), (3, 5, 6), (2, 12, 9)]):
        prompt = _prompt(batch, length, seed=20 + i)
        generation = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
        before = sum(_phases(wrapper.flops))
        out = wrapper.generate(**prompt, **generation)
        assert torch.equal(out, model.generate(**prompt, **generation)), (batch, length, new)
        assert sum(_phases(wrapper.flops)) - before == _reference(model, prompt, **generation), (attn, batch, length, new)
    # prefill and decode; with sdpa a prompt without padding is run without a mask (its own prefill)
    assert wrapper.captures == (2 if attn == "eager" else 3) and wrapper.flops.uncounted == 0


def test_a_chunked_prefill_is_counted_as_prefill_chunk_by_chunk():
    """``prefill_chunk_size``: the prompt runs in chunks, each against the cache of the ones before;
    every chunk is the prefill phase (transformers' prefill stage), the steps after it decode."""
    model = _text_model("llama", "eager")
    wrapper = fxflops.instrument(model, strict=True)
    for batch, length, chunk, new in ((2, 11, 4, 4),):  # 3 chunks, the last one short; left padding
        prompt = _prompt(batch, length, seed=length)
        generation = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, prefill_chunk_size=chunk)
        before = _phases(wrapper.flops)
        out = wrapper.generate(**prompt, **generation)
        prefill, decode = (now - then for now, then in zip(_phases(wrapper.flops), before))
        assert torch.equal(out, model.generate(**prompt, **generation))
        assert prefill == _reference(model, prompt, **dict(generation, max_new_tokens=1, min_new_tokens=1)), (batch, length, chunk)
        assert prefill + decode == _reference(model, prompt, **generation), (batch, length, chunk)
    assert "_prefill" not in vars(model) and "forward" not in vars(model)


class _HandsOver(torch.nn.Module):
    """A PEFT-style wrapper: its ``generate`` is the wrapped model's, whose forwards it never sees."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)


def test_a_generate_whose_forwards_run_in_another_model_is_not_counted_and_said():
    """Tokens produced with no forward of the instrumented model counted (a PEFT model's generate
    hands over to its base model's): the call is uncounted and said (was: 0 FLOPs, no warning)."""
    inner = _text_model("llama", "eager")
    wrapper = fxflops.instrument(_HandsOver(inner))
    prompt = _prompt(1, 6, 0)
    with pytest.warns(UserWarning, match="through another model's forward"):
        out = wrapper.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, inner.generate(**prompt, max_new_tokens=4, do_sample=False))
    assert wrapper.flops.uncounted == 1 and wrapper.flops.total() == 0 and wrapper.flops.generated_tokens == 0
