"""Families whose sizes their adapter derives (anyres tiles: LLaVA-NeXT, LLaVA-OneVision; patch
grids: Mistral 3, LLaVA-Pixtral; real frames: Idefics3, SmolVLM, Idefics2; image and audio tokens:
Phi-4-multimodal, its audio calls with 1-3 clips, half of them with images too):
counting cost per call, symbolic against measured.

Run: ``python benchmarks/symbolic_families.py`` (``--rounds 30``, ``--families mistral3``). The tiny
models and random batches of ``tests/test_hf_anyres.py``, ``test_hf_patch_grids.py``,
``test_hf_frames.py``, ``test_hf_crops.py`` and ``test_hf_audio.py`` (1-6 images of mixed sizes, 1-3 sequences), eager
attention. Medians of interleaved rounds over the batches, per call:

- capture: the first call's trace (seconds);
- prepare: the adapter's per-call work (packing anyres tiles, ``adapters/tiles.py``; nothing for the
  derived sizes, which the binder computes) and count: binding (derived sizes included) and
  accumulating, ``wrapper._count`` on the prepared call;
- the plain forward, the wrapper's forward (symbolic) and the ratio; the same wrapper with the
  family's adapter piece off (``measured``: the base model's own code measured per call, as before
  the piece) and its ratio;
- the forward under FlopCounterMode (``fails`` where it raises: Idefics2 under no_grad, whose
  perceiver latents, a view of a parameter, require grad without a grad_fn, which its module
  tracker does not accept).
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
import test_hf_anyres  # noqa: E402 - the tests' tiny models and batches
import test_hf_measured_families  # noqa: E402
import test_hf_patch_grids  # noqa: E402


def _grids(family: str):
    return test_hf_patch_grids.FAMILIES[family], lambda model, rng, images: test_hf_patch_grids.batch_of(family, rng, rng.randint(1, 6))


FAMILIES = {  # family -> (build, batch(model, rng, images=True), the adapter piece that makes it symbolic)
    **{f: (*pair, "tiles") for f, pair in test_hf_anyres.FAMILIES.items()},
    **{f: (*_grids(f), "grids") for f in test_hf_patch_grids.FAMILIES},
    "idefics3": (test_hf_measured_families.build_idefics3, test_hf_measured_families.idefics3_batch, "frames"),
    "smolvlm": (test_hf_measured_families.build_smolvlm, test_hf_measured_families.idefics3_batch, "frames"),
    "idefics2": (test_hf_measured_families.build_idefics2, test_hf_measured_families.idefics2_batch, "frames"),
    "phi4_multimodal": (test_hf_measured_families.build_phi4_multimodal, test_hf_measured_families.phi4_batch, "crops"),
    "phi4_audio": (
        test_hf_measured_families.build_phi4_multimodal,
        lambda model, rng, images: test_hf_measured_families.phi4_audio_batch(model, rng, audio=images), "audio",
    ),
}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(family: str, rounds: int, n_batches: int = 6) -> dict[str, float]:
    build, make_batch, piece = FAMILIES[family]
    model = build()
    rng = random.Random(1)
    batches = [make_batch(model, rng, images=True) for _ in range(n_batches)]
    for batch in batches:
        del batch["labels"]
    symbolic = fxflops.instrument(model, strict=True)
    measured = fxflops.instrument(model, strict=True)
    setattr(measured._adapter, piece, None)  # as before the piece: the base model's own code measured
    figures = {"capture": seconds(lambda: symbolic._count(*symbolic._adapter.prepare((), batches[0])))}
    with torch.no_grad():
        for batch in batches:  # every program and child program captured before timing
            symbolic(**batch)
            measured(**batch)
    samples: dict[str, list[float]] = {k: [] for k in ("prepare", "count", "plain", "symbolic", "measured", "flopcounter")}

    def flop_counter(batch: dict) -> None:
        with FlopCounterMode(display=False):
            model(**batch)

    with torch.no_grad():
        try:
            flop_counter(batches[0])
        except AssertionError:  # its module tracker's own failure (see the module docstring)
            samples.pop("flopcounter")
        for _ in range(rounds):
            for batch in batches:
                prepared = symbolic._adapter.prepare((), batch)
                samples["prepare"].append(seconds(lambda: symbolic._adapter.prepare((), batch)))
                samples["count"].append(seconds(lambda: symbolic._count(*prepared)))
                samples["plain"].append(seconds(lambda: model(**batch)))
                samples["symbolic"].append(seconds(lambda: symbolic(**batch)))
                samples["measured"].append(seconds(lambda: measured(**batch)))
                if "flopcounter" in samples:
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
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'family':16} {'capture s':>9} {'prepare us':>10} {'count us':>8} {'plain ms':>8} "
          f"{'symbolic/plain':>14} {'measured/plain':>14} {'FlopCounter/plain':>17}")
    for family in options.families:
        f = run(family, options.rounds)
        print(f"{family:16} {f['capture']:9.2f} {f['prepare'] * 1e6:10.0f} {f['count'] * 1e6:8.0f} {f['plain'] * 1e3:8.2f} "
              f"{f['symbolic'] / f['plain']:14.3f} {f['measured'] / f['plain']:14.3f} "
              + (f"{f['flopcounter'] / f['plain']:17.3f}" if "flopcounter" in f else f"{'fails':>17}"))


if __name__ == "__main__":
    main()
