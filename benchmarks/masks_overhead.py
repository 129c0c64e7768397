"""Counting cost of attention masks read from the graph, on a tiny HF Llama (sdpa, 2 layers).

Run: ``python benchmarks/masks_overhead.py``. For three kinds of call — a causal call without a mask,
a padded ``attention_mask`` (the kept triples summed from it per call) and packed ``position_ids``
without ``attention_mask`` (the block-diagonal mask's kept triples summed from the runs of the
positions) — prints medians of interleaved runs: the plain forward, the forward under FlopCounterMode,
and fxflops' counting of the same call (``wrapper._count``: binding, statistics, guards, meter), with
the statistic computed on the host (CPU metadata) and with tensor ops (as on an accelerator).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

import fxflops


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _calls(batch: int, seq: int) -> dict[str, dict]:
    ids = torch.randint(0, 64, (batch, seq))
    padding = torch.ones(batch, seq, dtype=torch.long)
    padding[0, seq // 2 :] = 0
    positions = torch.cat([torch.arange(seq // 4), torch.arange(seq - seq // 4)]).repeat(batch, 1)
    return {
        "causal, no mask": {"input_ids": ids},
        "attention_mask with padding": {"input_ids": ids, "attention_mask": padding},
        "packed position_ids": {"input_ids": ids, "position_ids": positions},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    options = parser.parse_args()
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    print(f"tiny HF Llama, 2 layers, batch {options.batch} x seq {options.seq}; medians of {options.rounds} interleaved rounds")
    for name, kwargs in _calls(options.batch, options.seq).items():
        wrapper = fxflops.instrument(model, strict=True)
        with torch.no_grad():
            wrapper(**kwargs)  # capture

            def plain() -> None:
                model(**kwargs)

            def under_flopcounter() -> None:
                with FlopCounterMode(display=False):
                    model(**kwargs)

            def count(host: bool) -> float:
                wrapper.program.binder.host_metadata = host
                return _seconds(lambda: [wrapper._count((), kwargs) for _ in range(100)]) / 100

            samples: dict[str, list[float]] = {"plain": [], "flopcounter": [], "host": [], "tensor ops": []}
            for _ in range(options.rounds):
                samples["plain"].append(_seconds(plain))
                samples["flopcounter"].append(_seconds(under_flopcounter))
                samples["host"].append(count(True))
                samples["tensor ops"].append(count(False))
        med = {k: statistics.median(v) for k, v in samples.items()}
        added = med["flopcounter"] - med["plain"]
        symbols = sorted(str(s) for s in wrapper.program.all_symbols if "pairs" in str(s))
        print(
            f"  {name:30s} counting {med['host'] * 1e6:6.1f} us (tensor ops {med['tensor ops'] * 1e6:6.1f} us); "
            f"plain forward {med['plain'] * 1e3:.2f} ms ({med['host'] / med['plain']:.2%}); "
            f"FlopCounterMode adds {added * 1e3:.2f} ms ({added / med['host']:.0f}x fxflops); statistics {symbols or 'none'}"
        )


if __name__ == "__main__":
    main()
