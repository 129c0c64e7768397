"""Training-step time with ``torch.compile`` + the fxflops backend versus ``torch.compile`` alone.

Run: ``python benchmarks/compile_overhead.py [--backend aot_eager|inductor]``. The example VLM is
compiled twice (``dynamic=True``): with the inner backend alone, and with ``fxflops.backend(inner)``.
Both are warmed up on every batch (so every recompile has happened), then rounds alternate between
them on the same batches (forward, backward, AdamW step) and the medians are compared. Target
(issue 4): ratio <= 1.01. Also prints the compiled graphs' count and that the counts equal
``instrument()``'s.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = VLMConfig()
    plain_model = TinyVLM(cfg)
    counted_model = copy.deepcopy(plain_model)
    rng = random.Random(0)
    batches = [random_batch(cfg, rng, images=(2, 4), sequences=(4, 16)) for _ in range(4)]
    counter = fxflops.backend(args.backend, model=counted_model)
    plain = torch.compile(plain_model, backend=args.backend, dynamic=True)
    counted = torch.compile(counted_model, backend=counter, dynamic=True)
    optimizers = {id(plain): torch.optim.AdamW(plain_model.parameters()), id(counted): torch.optim.AdamW(counted_model.parameters())}

    def step(compiled, batch) -> float:
        start = time.perf_counter()
        compiled(*batch.inputs()).float().logsumexp(-1).mean().backward()
        optimizers[id(compiled)].step()
        optimizers[id(compiled)].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    start = time.perf_counter()
    for batch in batches:
        step(plain, batch)
    plain_compile = time.perf_counter() - start
    start = time.perf_counter()
    for batch in batches:
        step(counted, batch)
    counted_compile = time.perf_counter() - start

    times: dict[str, list[float]] = {"plain": [], "counted": []}
    for r in range(args.rounds):
        batch = batches[r % len(batches)]
        times["plain"].append(step(plain, batch))
        times["counted"].append(step(counted, batch))
    p, c = statistics.median(times["plain"]), statistics.median(times["counted"])

    wrapper = fxflops.instrument(counted_model, dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}}, backward=True)
    counter.flops.reset()
    for batch in batches:
        step(counted, batch)
        wrapper(*batch.inputs()).float().sum().backward()
    same = counter.flops.total() == wrapper.flops.total()
    print(f"TinyVLM training step, torch.compile(dynamic=True, backend={args.backend!r}), median of {args.rounds} interleaved rounds, CPU")
    print(f"  warm-up incl. compiles: alone {plain_compile:.1f} s, with fxflops {counted_compile:.1f} s ({counter.graphs} graphs)")
    print(f"  step, compile alone        {p * 1e3:8.2f} ms")
    print(f"  step, compile + fxflops    {c * 1e3:8.2f} ms")
    print(f"  ratio                      {c / p:8.4f}  (target <= 1.01)")
    print(f"  counts equal instrument(): {same} ({counter.flops.total():,} FLOPs over {len(batches)} steps, uncounted {counter.flops.uncounted})")


if __name__ == "__main__":
    main()
