"""Hugging Face VLMs, zero-config: capture time by depth and counting cost per microbatch.

Run: ``python benchmarks/hf_models.py`` (``--families qwen2_vl llava_clip``, ``--depths 2 24``).
For each tiny family of ``fxflops/models/hf_zoo.py`` (sdpa attention):

- capture time of ``fxflops.instrument(model, backward=True)``'s first call (the joint forward +
  backward trace) with 2 and 24 text layers and as many vision layers; per layer = over all layers
  (text + vision). Target (issue 5): <= 0.15 s per layer.
- per microbatch, medians of interleaved rounds over random batches: fxflops counting (bind the
  shapes and offsets, check guards, accumulate: ``wrapper._count`` on the prepared call; target
  <= 50 us) and its binding alone, the adapter's ``prepare`` (the metadata it derives: M-RoPE
  positions, vision offsets and positions, which the model then skips: moved, not added; the
  vision metadata is kept per grid, so each figure also with every grid new), the
  model's forward as the user calls it and with the derived metadata passed in, the whole wrapper
  call against the plain call (target <= 1.01, issue 14), and the forward under FlopCounterMode.

Counting is also timed once right after each forward: the forward leaves the processor's caches
holding its own code and data, and the first Python after it runs several times slower than in a
loop (an empty call: about 2.8 us instead of 0.05 on the 2-core test machine). That is the cost a
real step pays; the loop figure is the warm one.

On CPU a call's time also depends on how glibc's allocator hands the forward's large blocks back
and forth with the kernel: any module wrapping the model moves that (measured: a module whose
forward only calls the model, 389 minor page faults per gemma3 call against 303 plain, +12 %). So
each round also times such a forwarding module, in rotating order with the plain and the wrapper
call, and prints the page faults per call: the wrapper against the forwarding module is fxflops'
own share; against the plain call, the allocator's share is in it too.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.models import hf_zoo


def _seconds(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def capture_seconds(family: str, depth: int) -> tuple[float, int]:
    """Seconds of the first (capturing) call at ``depth`` text and vision layers, and the layers."""
    model = hf_zoo.build(family, "sdpa", text_layers=depth, vision_layers=depth)
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    batch = hf_zoo.random_batch(family, random.Random(0), videos=0)
    start = time.perf_counter()
    wrapper._count(*wrapper._adapter.prepare((), batch), training=True)
    return time.perf_counter() - start, 2 * depth


class Forwarding(torch.nn.Module):
    """A module whose forward only calls the model: the control for what wrapping costs by itself."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def counting_cost(family: str, rounds: int, n_batches: int) -> dict[str, float]:
    model = hf_zoo.build(family, "sdpa")
    wrapper = fxflops.instrument(model, strict=True)
    forwarding = Forwarding(model)
    rng = random.Random(1)
    batches = [hf_zoo.random_batch(family, rng) for _ in range(n_batches)]
    kinds = (
        "count", "count_in_situ", "empty_in_situ", "bind", "derive", "derive_new", "plain", "with_metadata", "wrapper", "forwarding", "ratio", "ratio_own",
        "ratio_wrapping", "ratio_new", "flopcounter", "faults_plain", "faults_forwarding", "faults_wrapper",
    )
    samples: dict[str, list[float]] = {k: [] for k in kinds}

    def forget() -> None:  # a grid the adapter has not derived metadata for (a new resolution)
        wrapper._adapter._derived_by_grid.clear()

    with torch.no_grad():
        wrapper(**batches[0])  # capture
        for r in range(rounds):
            batch = batches[r % n_batches]
            args, kwargs = wrapper._adapter.prepare((), batch)
            binder = wrapper._program_for(args, kwargs)[0].binder
            samples["count"].append(_seconds(lambda: wrapper._count(args, kwargs), repeat=200))
            samples["bind"].append(_seconds(lambda: binder.values(args, kwargs), repeat=200))
            samples["derive"].append(_seconds(lambda: wrapper._adapter.prepare((), batch), repeat=5))
            samples["derive_new"].append(_seconds(lambda: (forget(), wrapper._adapter.prepare((), batch)), repeat=5))
            samples["with_metadata"].append(_seconds(lambda: model(*args, **kwargs)))
            samples["count_in_situ"].append(_seconds(lambda: wrapper._count(args, kwargs)))  # right after a forward
            model(*args, **kwargs)
            samples["empty_in_situ"].append(_seconds(lambda: None))
            three = [("plain", lambda: model(**batch)), ("forwarding", lambda: forwarding(**batch)), ("wrapper", lambda: wrapper(**batch))]
            for kind, call in three[r % 3 :] + three[: r % 3]:  # adjacent, in rotating order
                faults = _faults()
                samples[kind].append(_seconds(call))
                samples[f"faults_{kind}"].append(_faults() - faults)
            samples["ratio"].append(samples["wrapper"][-1] / samples["plain"][-1])
            samples["ratio_wrapping"].append(samples["forwarding"][-1] / samples["plain"][-1])  # the allocator's share
            samples["ratio_own"].append(samples["wrapper"][-1] / samples["forwarding"][-1])  # fxflops' own share
            pair = [("plain", lambda: model(**batch)), ("wrapper", lambda: (forget(), wrapper(**batch)))]
            new = {kind: _seconds(call) for kind, call in (pair if r % 2 else reversed(pair))}
            samples["ratio_new"].append(new["wrapper"] / new["plain"])

            def under_flopcounter() -> None:
                with FlopCounterMode(display=False):
                    model(**batch)

            samples["flopcounter"].append(_seconds(under_flopcounter))
    assert wrapper.captures == 1, "one program serves every batch"
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(hf_zoo.FAMILIES))
    parser.add_argument("--depths", type=int, nargs="*", default=[2, 24])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    us = 1e6
    print(f"torch {torch.__version__}, CPU, sdpa attention, tiny configs (hidden 64), random weights")
    for family in args.families:
        print(f"\n{family}")
        for depth in args.depths:
            seconds, layers = capture_seconds(family, depth)
            print(f"  capture fwd+bwd, {depth}+{depth} layers      {seconds:8.2f} s   {seconds / layers:6.3f} s/layer  (target <= 0.15)")
        med = counting_cost(family, args.rounds, args.batches)
        added = med["flopcounter"] - med["plain"]
        print(f"  fxflops counting per microbatch        {med['count'] * us:8.1f} us  (target <= 50 us), of which binding {med['bind'] * us:.1f} us")
        print(
            f"  counting right after a forward (in situ) {med['count_in_situ'] * us:8.1f} us "
            f"(an empty call timed so: {med['empty_in_situ'] * us:.1f} us)"
        )
        print(f"  adapter prepare (metadata moved from the model) {med['derive'] * us:8.1f} us, a new grid {med['derive_new'] * us:.1f} us")
        print(f"  forward as called / with metadata       {med['plain'] * us:8.0f} us / {med['with_metadata'] * us:.0f} us")
        print(f"  wrapper call / plain call               {med['ratio']:8.3f}  (median of adjacent pairs; target <= 1.01), every grid new {med['ratio_new']:.3f}")
        print(f"  forwarding module / plain call          {med['ratio_wrapping']:8.3f}  (wrapping alone: the allocator's share)")
        print(f"  wrapper call / forwarding module        {med['ratio_own']:8.3f}  (fxflops' own share)")
        print(
            f"  minor page faults per call: plain {med['faults_plain']:.0f}, forwarding {med['faults_forwarding']:.0f}, "
            f"wrapper {med['faults_wrapper']:.0f}"
        )
        print(f"  forward under FlopCounterMode           {med['flopcounter'] * us:8.0f} us  (+{added * us:.0f} us, {added / med['count']:,.0f}x fxflops)")


if __name__ == "__main__":
    main()
