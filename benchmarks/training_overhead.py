"""Training-step time with ``instrument(backward=True)`` versus the plain eager step.

Run: ``python benchmarks/training_overhead.py``. The example VLM trains on random packed multimodal
microbatches (forward, backward, AdamW step); rounds alternate between the plain model and the
instrumented one (same weights, same batches) and the medians are compared. Target (issue 4): ratio
<= 1.01. The first instrumented call (the capture) is timed separately.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = VLMConfig(vision_layers=args.layers, layers=args.layers)
    model = TinyVLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrapper = fxflops.instrument(model, dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}}, backward=True)
    rng = random.Random(0)
    batches = [random_batch(cfg, rng) for _ in range(8)]

    def step(module, batch) -> float:
        start = time.perf_counter()
        loss = module(*batch.inputs()).float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    capture_s = step(wrapper, batches[0])
    for batch in batches:  # warm-up both paths
        step(model, batch)
        step(wrapper, batch)
    plain, counted = [], []
    for r in range(args.rounds):
        batch = batches[r % len(batches)]
        plain.append(step(model, batch))
        counted.append(step(wrapper, batch))
    p, c = statistics.median(plain), statistics.median(counted)
    meter = wrapper.flops
    print(f"TinyVLM ({cfg.vision_layers}+{cfg.layers} layers) training step, median of {args.rounds} interleaved rounds, CPU")
    print(f"  first instrumented step (joint fwd+bwd capture)  {capture_s:8.2f} s")
    print(f"  plain eager step                                  {p * 1e3:8.2f} ms")
    print(f"  instrument(backward=True) step                    {c * 1e3:8.2f} ms")
    print(f"  ratio                                             {c / p:8.4f}  (target <= 1.01)")
    print(
        f"  counted over {meter.calls} steps: fwd {meter.total(phase='fwd'):,}  bwd {meter.total(phase='bwd'):,}  "
        f"recompute {meter.total(phase='recompute'):,} FLOPs"
    )


if __name__ == "__main__":
    main()
