"""Anyres tiles (LLaVA-NeXT, LLaVA-OneVision): counting cost per call, symbolic against measured.

Run: ``python benchmarks/anyres_overhead.py`` (``--rounds 30``). The tiny models and random batches
of ``tests/test_hf_anyres.py`` (1-6 images of mixed sizes, 1-3 sequences), eager attention. Medians
of interleaved rounds over the batches, per call:

- capture: the first call's trace (seconds);
- prepare: the adapter packing each image's tiles (``adapters/tiles.py``; the model then skips its
  own copy) and count: binding and accumulating, ``wrapper._count`` on the prepared call;
- the plain forward, the wrapper's forward (symbolic) and the ratio; the same wrapper with the tiles
  handling off (``measured``: the base model's own code measured per call, as before) and its ratio;
- the forward under FlopCounterMode.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_hf_anyres import FAMILIES  # noqa: E402 - the tests' tiny models and batches


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(family: str, rounds: int, n_batches: int = 6) -> dict[str, float]:
    build, make_batch = FAMILIES[family]
    model = build()
    rng = random.Random(1)
    batches = [make_batch(model, rng, images=True) for _ in range(n_batches)]
    for batch in batches:
        del batch["labels"]
    symbolic = fxflops.instrument(model, strict=True)
    measured = fxflops.instrument(model, strict=True)
    measured.adapter.tiles = None  # as before adapters/tiles.py: the base model's own code measured
    figures = {"capture": seconds(lambda: symbolic._count(*symbolic.adapter.prepare((), batches[0])))}
    with torch.no_grad():
        for batch in batches:  # every program and child program captured before timing
            symbolic(**batch)
            measured(**batch)
    samples: dict[str, list[float]] = {k: [] for k in ("prepare", "count", "plain", "symbolic", "measured", "flopcounter")}

    def flop_counter(batch: dict) -> None:
        with FlopCounterMode(display=False):
            model(**batch)

    with torch.no_grad():
        for _ in range(rounds):
            for batch in batches:
                prepared = symbolic.adapter.prepare((), batch)
                samples["prepare"].append(seconds(lambda: symbolic.adapter.prepare((), batch)))
                samples["count"].append(seconds(lambda: symbolic._count(*prepared)))
                samples["plain"].append(seconds(lambda: model(**batch)))
                samples["symbolic"].append(seconds(lambda: symbolic(**batch)))
                samples["measured"].append(seconds(lambda: measured(**batch)))
                samples["flopcounter"].append(seconds(lambda: flop_counter(batch)))
        symbolic.flops.reset()
        measured.flops.reset()
        for batch in batches:  # the same count both ways (the timed _count calls added to the meter)
            symbolic(**batch)
            measured(**batch)
    assert symbolic.measured == {} and measured.measured and symbolic.flops.uncounted == measured.flops.uncounted == 0
    assert symbolic.flops.total() == measured.flops.total()
    figures.update({k: statistics.median(v) for k, v in samples.items()})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'family':16} {'capture s':>9} {'prepare us':>10} {'count us':>8} {'plain ms':>8} "
          f"{'symbolic/plain':>14} {'measured/plain':>14} {'FlopCounter/plain':>17}")
    for family in FAMILIES:
        f = run(family, options.rounds)
        print(f"{family:16} {f['capture']:9.2f} {f['prepare'] * 1e6:10.0f} {f['count'] * 1e6:8.0f} {f['plain'] * 1e3:8.2f} "
              f"{f['symbolic'] / f['plain']:14.3f} {f['measured'] / f['plain']:14.3f} {f['flopcounter'] / f['plain']:17.3f}")


if __name__ == "__main__":
    main()
