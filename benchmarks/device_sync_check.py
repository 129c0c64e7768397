"""GPU check: counting a microbatch never synchronises the host with the device.

Run on a machine with CUDA: ``python benchmarks/device_sync_check.py``. The example VLM is captured
once; then, for random microbatches whose metadata (``cu_seqlens``, ``image_grid_thw``) lives on the
GPU, the counting path of ``instrument()`` (binding shapes, segment power sums with tensor ops on the
device, guard checks, meter accumulation) runs under ``torch.cuda.set_sync_debug_mode("error")``, which
raises on any synchronising CUDA call. The meter is read once at the end (one copy) and compared with
the same batches counted from host metadata. Then the same for a tiny HF Llama whose attention masks
are read from the graph: a padded ``attention_mask`` and packed ``position_ids`` (the kept-pairs
statistics summed on the device). Then sizes derived from input values (``capture/derived.py``):
Idefics3's real frames, Mistral 3's kept patches and Phi-4-multimodal's image tokens (the tests'
tiny models), whose guards are device flags (``fxflops/guards.py``). Prints the per-microbatch
counting time on the device.
"""

from __future__ import annotations

import random
import sys
import time

import torch

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU")
        return 2
    cfg = VLMConfig()
    model = TinyVLM(cfg)
    rng = random.Random(0)
    batches = [random_batch(cfg, rng) for _ in range(16)]
    wrapper = fxflops.instrument(model, dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}})
    with torch.no_grad():
        wrapper(*batches[0].inputs())  # capture on the host
    expected = sum(wrapper.program.count(*b.inputs()) for b in batches)
    on_device = [tuple(t.cuda() for t in b.inputs()) for b in batches]
    wrapper.flops.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    start = time.perf_counter()
    for inputs in on_device:
        wrapper._count(inputs, {})
    elapsed = time.perf_counter() - start
    torch.cuda.set_sync_debug_mode("default")
    got = wrapper.flops.total()
    print(f"counted {len(on_device)} microbatches with device metadata under sync debug mode 'error': no sync")
    print(f"  {elapsed / len(on_device) * 1e6:.1f} us per microbatch (host time, kernels queued asynchronously)")
    print(f"  total {got:,} FLOPs; from host metadata {expected:,}: {'equal' if got == expected else 'DIFFERENT'}")
    return 0 if got == expected and text_masks() and derived_sizes() else 1


def text_masks() -> bool:
    """HF Llama calls whose mask statistics come from device tensors: no sync, equal to the host's."""
    import transformers

    from fxflops.conventions import FLOPCOUNTER

    exact = FLOPCOUNTER.but(causal="exact")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa", use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids, padding = torch.randint(0, 64, (2, 16)), torch.ones(2, 16, dtype=torch.long)
    padding[0, 9:] = 0
    positions = torch.cat([torch.arange(5), torch.arange(11)]).repeat(2, 1)
    ok = True
    for name, kwargs in (("attention_mask", {"attention_mask": padding}), ("packed position_ids", {"position_ids": positions})):
        wrapper = fxflops.instrument(model, strict=True)
        with torch.no_grad():
            wrapper(input_ids=ids, **kwargs)
        host = wrapper.flops.total(convention=exact)
        on_device = {"input_ids": ids.cuda(), **{k: v.cuda() for k, v in kwargs.items()}}
        wrapper.flops.reset()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        wrapper._count((), on_device)
        torch.cuda.set_sync_debug_mode("default")
        got = wrapper.flops.total(convention=exact)
        print(f"HF Llama, {name} on the GPU: no sync; exact-causal total {got:,}, host {host:,}: {'equal' if got == host else 'DIFFERENT'}")
        ok &= got == host
    return ok


def derived_sizes() -> bool:
    """The derived-size families of the tests, their inputs on the GPU: no sync, equal to the host's."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_hf_derived_on_device import FAMILIES  # the tests' tiny models and batches

    ok = True
    for family, (build, make_batch) in FAMILIES.items():
        model = build()
        rng = random.Random(family)
        batches = [make_batch(model, rng, True) for _ in range(6)]
        wrapper = fxflops.instrument(model, strict=True)
        host = 0
        for batch in batches:
            batch.pop("labels")
            wrapper.flops.reset()
            with torch.no_grad():
                wrapper(**batch)  # captured (and counted) on the host
            host += wrapper.flops.total()
        prepared = [wrapper._adapter.prepare((), {k: v.cuda() for k, v in b.items()}) for b in batches]
        wrapper.flops.reset()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for args, kwargs in prepared:
            wrapper._count(args, kwargs)
        torch.cuda.set_sync_debug_mode("default")
        got = wrapper.flops.total()
        print(f"{family}, derived sizes on the GPU: no sync; total {got:,}, host {host:,}: {'equal' if got == host else 'DIFFERENT'}")
        ok &= got == host
    return ok


if __name__ == "__main__":
    sys.exit(main())
