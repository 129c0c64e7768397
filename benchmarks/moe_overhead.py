"""Mixture of experts: counting cost per microbatch, and what measuring the routing adds.

Run: ``python benchmarks/moe_overhead.py``. For a plain-torch MoE GPT with a grouped-GEMM capacity
dispatch and for a tiny transformers Mixtral (eager experts loop), medians of interleaved rounds of:
the plain forward, the forward through ``instrument(model)`` (``moe="model"``: counting from shapes
only), through ``instrument(model, measure_routing=True)`` (``moe="actual"``: the expert modules run
under a scoped dispatch mode), and under FlopCounterMode.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def mixtral() -> torch.nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
    )
    config._attn_implementation, config._experts_implementation = "sdpa", "eager"
    return transformers.MixtralForCausalLM(config).eval()


def measure(name: str, model: torch.nn.Module, calls: list, rounds: int) -> None:
    counted = fxflops.instrument(model)
    measured = fxflops.instrument(model, measure_routing=True)
    samples: dict[str, list[float]] = {k: [] for k in ("plain", "model", "actual", "flopcounter")}
    with torch.no_grad():
        counted(*calls[0][0], **calls[0][1])  # captures
        measured(*calls[0][0], **calls[0][1])
        for r in range(rounds):
            args, kwargs = calls[r % len(calls)]
            samples["plain"].append(_seconds(lambda: model(*args, **kwargs)))
            samples["model"].append(_seconds(lambda: counted(*args, **kwargs)))
            samples["actual"].append(_seconds(lambda: measured(*args, **kwargs)))

            def under_flopcounter() -> None:
                with FlopCounterMode(display=False):
                    model(*args, **kwargs)

            samples["flopcounter"].append(_seconds(under_flopcounter))
    med = {k: statistics.median(v) for k, v in samples.items()}
    us = 1e6
    print(f"\n{name}: {len(calls)} random microbatches, median of {rounds} interleaved rounds, CPU")
    print(f"  plain forward                             {med['plain'] * us:9.0f} us")
    print(f"  instrument (moe='model', shapes only)     {med['model'] * us:9.0f} us  (+{(med['model'] - med['plain']) * us:.0f} us)")
    print(f"  instrument(measure_routing=True)          {med['actual'] * us:9.0f} us  (+{(med['actual'] - med['plain']) * us:.0f} us)")
    print(f"  forward under FlopCounterMode             {med['flopcounter'] * us:9.0f} us  (+{(med['flopcounter'] - med['plain']) * us:.0f} us)")
    report = measured.flops
    actual = fxflops.conventions.FLOPCOUNTER.but(moe="actual")
    print(f"  last window: model {report.total():,} FLOPs, actual {report.total(convention=actual):,} FLOPs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rng = random.Random(0)
    cfg = GPTConfig(vocab=256, hidden=64, heads=4, kv_heads=2, ffn=128, layers=4, experts=8, top_k=2,
                    expert_ffn=64, dispatch="grouped", capacity_factor=1.0)
    torch.manual_seed(0)
    calls = [((torch.randint(0, 256, (rng.randint(1, 4), rng.randint(16, 128))),), {}) for _ in range(8)]
    measure("MoE GPT, grouped GEMM with capacity 1.0 (4 layers, 8 experts, top-2)", TinyGPT(cfg), calls, args.rounds)
    calls = [((), {"input_ids": torch.randint(0, 256, (rng.randint(1, 4), rng.randint(16, 128)))}) for _ in range(8)]
    measure("transformers Mixtral, eager experts loop (4 layers, 8 experts, top-2)", mixtral(), calls, args.rounds)


if __name__ == "__main__":
    main()
