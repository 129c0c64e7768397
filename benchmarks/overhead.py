"""Counting cost of ``instrument()`` vs FlopCounterMode and the plain forward; capture vs torch.export.

Run: ``python benchmarks/overhead.py``. Prints medians of interleaved runs (plain forward,
FlopCounterMode forward, fxflops counting of the same call, in turn each round) and their ratios, then
capture time of ``fxflops.trace`` and ``torch.export`` (non-strict, dynamic batch and seq) at 2, 8 and
24 layers. Targets (issue 2): counting <= 20 us per call, >= 500x cheaper than FlopCounterMode's added
time, capture <= 0.15 s per transformer layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def counting_overhead(rounds: int, layers: int, batch: int, seq: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(layers=layers))
    wrapper = fxflops.instrument(model, dims={"input_ids": {0: "batch", 1: "seq"}})
    ids = torch.randint(0, model.cfg.vocab, (batch, seq))
    args, kwargs = (ids,), {}
    with torch.no_grad():
        wrapper(ids)  # capture once (the example call)

        def plain() -> None:
            model(ids)

        def under_flopcounter() -> None:
            with FlopCounterMode(display=False):
                model(ids)

        def count() -> None:  # exactly what wrapper.forward adds to the model's own call
            wrapper._count(args, kwargs)

        for fn in (plain, under_flopcounter, count):
            fn()  # warm-up
        samples: dict[str, list[float]] = {"plain": [], "flopcounter": [], "fxflops": []}
        for _ in range(rounds):
            samples["plain"].append(_seconds(plain))
            samples["flopcounter"].append(_seconds(under_flopcounter))
            # one counting call is ~microseconds: time 100 back-to-back and divide
            samples["fxflops"].append(_seconds(lambda: [count() for _ in range(100)]) / 100)
    med = {k: statistics.median(v) for k, v in samples.items()}
    med["flopcounter_added"] = med["flopcounter"] - med["plain"]
    return med


def capture_times(layer_counts: list[int]) -> list[tuple[int, float, float]]:
    rows = []
    for layers in layer_counts:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(layers=layers))
        ids = torch.randint(0, model.cfg.vocab, (2, 64))
        t_fx = _seconds(lambda: fxflops.trace(model, (ids,), dims={"input_ids": {0: "batch", 1: "seq"}}))
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        t_export = _seconds(
            lambda: torch.export.export(model, (ids,), dynamic_shapes=({0: batch, 1: seq},), strict=False)
        )
        rows.append((layers, t_fx, t_export))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--capture-layers", type=int, nargs="*", default=[2, 8, 24])
    args = parser.parse_args()

    med = counting_overhead(args.rounds, args.layers, args.batch, args.seq)
    us = 1e6
    print(
        f"TinyGPT {args.layers} layers, batch {args.batch} x seq {args.seq}, "
        f"median of {args.rounds} interleaved rounds (CPU, no_grad forward)"
    )
    print(f"  plain forward                 {med['plain'] * us:12.1f} us")
    print(f"  forward under FlopCounterMode {med['flopcounter'] * us:12.1f} us  (+{med['flopcounter_added'] * us:.1f} us added)")
    print(f"  fxflops counting per call     {med['fxflops'] * us:12.2f} us  (target <= 20 us)")
    print(f"  FlopCounterMode added / fxflops counting = {med['flopcounter_added'] / med['fxflops']:,.0f}x  (target >= 500x)")
    print(f"  fxflops counting / plain forward        = {100 * med['fxflops'] / med['plain']:.4f} %")

    print("\ncapture time (trace once) vs torch.export(strict=False, dynamic batch & seq)")
    print(f"  {'layers':>6}  {'fxflops.trace':>13}  {'per layer':>9}  {'torch.export':>12}  {'export/trace':>12}")
    for layers, t_fx, t_export in capture_times(args.capture_layers):
        print(f"  {layers:>6}  {t_fx:>11.2f} s  {t_fx / layers:>7.3f} s  {t_export:>10.2f} s  {t_export / t_fx:>11.1f}x")
    print("  target: <= 0.15 s per transformer layer")


if __name__ == "__main__":
    main()
