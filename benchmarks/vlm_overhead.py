"""Per-microbatch counting cost on the example VLM (segment power sums included).

Run: ``python benchmarks/vlm_overhead.py``. For random packed multimodal microbatches (1-8 images,
1-3 frames, 1-32 packed text sequences), medians of interleaved rounds of: the plain forward, the
forward under FlopCounterMode, and fxflops counting the same call (binding shapes, reading the
metadata's power sums, checking guards, accumulating). Targets (issue 3): <= 50 us per microbatch on
CPU, >= 500x cheaper than FlopCounterMode's added time. Also times the device-style path (power sums
with tensor ops, as for metadata on an accelerator) on CPU tensors.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch


def _seconds(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def measure(cfg: VLMConfig, rounds: int, n_batches: int) -> None:
    torch.manual_seed(0)
    model = TinyVLM(cfg)
    rng = random.Random(0)
    batches = [random_batch(cfg, rng) for _ in range(n_batches)]
    wrapper = fxflops.instrument(model, dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}})
    samples: dict[str, list[float]] = {"plain": [], "flopcounter": [], "fxflops": [], "fxflops_device_path": []}
    with torch.no_grad():
        start = time.perf_counter()
        wrapper(*batches[0].inputs())
        capture_s = time.perf_counter() - start
        program = wrapper.program
        for r in range(rounds):
            batch = batches[r % len(batches)]
            inputs = batch.inputs()
            samples["plain"].append(_seconds(lambda: model(*inputs)))

            def under_flopcounter() -> None:
                with FlopCounterMode(display=False):
                    model(*inputs)

            samples["flopcounter"].append(_seconds(under_flopcounter))
            samples["fxflops"].append(_seconds(lambda: wrapper._count(inputs, {}), repeat=200))
            program.binder.host_metadata = False
            samples["fxflops_device_path"].append(_seconds(lambda: wrapper._count(inputs, {}), repeat=200))
            program.binder.host_metadata = True
            wrapper.flops.reset()  # the device path's sums are 0-d tensors: the host path's are ints again
    med = {k: statistics.median(v) for k, v in samples.items()}
    added = med["flopcounter"] - med["plain"]
    us = 1e6
    images = [len(b.image_grid_thw) for b in batches]
    sequences = [len(b.sequence_lengths) for b in batches]
    print(
        f"TinyVLM ({cfg.vision_layers}+{cfg.layers} layers), {len(batches)} random microbatches "
        f"(images {min(images)}-{max(images)}, packed sequences {min(sequences)}-{max(sequences)}), "
        f"median of {rounds} interleaved rounds, CPU"
    )
    print(f"  capture (first call)                  {capture_s:10.2f} s   symbols: {[str(s) for s in program.symbols]}")
    print(f"  plain forward                         {med['plain'] * us:10.1f} us")
    print(f"  forward under FlopCounterMode         {med['flopcounter'] * us:10.1f} us  (+{added * us:.1f} us added)")
    print(f"  fxflops counting per microbatch       {med['fxflops'] * us:10.2f} us  (target <= 50 us)")
    print(f"  ... with device-style power sums      {med['fxflops_device_path'] * us:10.2f} us  (tensor ops, no sync)")
    print(f"  FlopCounterMode added / fxflops       {added / med['fxflops']:10,.0f}x  (target >= 500x)")
    print(f"  fxflops / plain forward               {100 * med['fxflops'] / med['plain']:10.4f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--layers", type=int, nargs="*", default=[2, 8], help="vision and text depth")
    args = parser.parse_args()
    for layers in args.layers:  # counting cost does not grow with depth; FlopCounterMode's does
        measure(VLMConfig(vision_layers=layers, layers=layers), args.rounds, args.batches)
        print()


if __name__ == "__main__":
    main()
