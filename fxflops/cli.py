"""Command line: ``python -m fxflops demo`` (also the ``fxflops`` console script)."""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, forward_flops_formula, random_batch
from fxflops.report import human


def demo(args: argparse.Namespace) -> int:
    """Trace the example VLM once; print symbols, closed form, per-module table, a formula check and
    per-microbatch counts from ``instrument()``."""
    torch.manual_seed(0)
    cfg = VLMConfig(vision_layers=args.layers, layers=args.layers)
    model = TinyVLM(cfg)
    rng = random.Random(0)
    dims = {"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}}
    segments = {"cu_seqlens": "text", "image_grid_thw": "frames"}
    start = time.perf_counter()
    program = fxflops.trace(model, random_batch(cfg, rng).inputs(), dims=dims, segments=segments)
    print(
        f"TinyVLM (Qwen2-VL-shaped: {cfg.vision_layers}-block ViT with per-frame attention, 2x2 merger, "
        f"{cfg.layers}-layer GQA/SwiGLU LM over packed text) traced once in {time.perf_counter() - start:.2f} s\n"
    )
    meaning = program.describe_symbols()
    for name in ("tokens", "patches", "text_p2", "frames_p2"):
        print(f"  {name:<10} {meaning[name]}")
    print(f"\nclosed form: FLOPs = {program.formula()}\n")

    sequences, seq_len, images, side = 8, 512, 4, 32
    example = {
        "tokens": sequences * seq_len,
        "patches": images * side * side,
        "text_p2": sequences * seq_len**2,
        "frames_p2": images * (side * side) ** 2,
    }
    print(f"example microbatch: {sequences} packed sequences x {seq_len} tokens, {images} images of {side}x{side} patches")
    print(program.table(depth=args.depth, **example))

    def hand_formula(tokens, patches, text_p2, frames_p2):
        return forward_flops_formula(cfg, tokens, patches, text_p2, frames_p2)

    verdict = fxflops.verify(program, hand_formula)
    print("\nformula check: fxflops.models.tiny_vlm.forward_flops_formula against the traced program")
    print(verdict)

    def pack_length_squared(tokens, patches, text_p2, frames_p2):  # the field's bug, for contrast
        return forward_flops_formula(cfg, tokens, patches, tokens**2, frames_p2)

    print("\nthe same check of a formula with the pack-length² shortcut (tokens² for the attention core):")
    print("\n".join(str(fxflops.verify(program, pack_length_squared)).splitlines()[3:]))
    packed_as_one = program.total(**{**example, "text_p2": example["tokens"] ** 2})
    print(
        f"the pack-length² shortcut (one {example['tokens']}-token sequence) would say {human(packed_as_one)} "
        f"instead of {human(program.total(**example))}"
    )

    wrapper = fxflops.instrument(model, dims=dims, segments=segments)
    batches = [random_batch(cfg, rng) for _ in range(args.microbatches)]
    with torch.no_grad():
        for batch in batches:
            wrapper(*batch.inputs())
    repeats = 100
    start = time.perf_counter()
    for _ in range(repeats):
        for batch in batches:
            wrapper._count(batch.inputs(), {})
    per_call_us = (time.perf_counter() - start) / (repeats * len(batches)) * 1e6
    wrapper.flops.reset()
    for batch in batches:
        wrapper._count(batch.inputs(), {})
    shapes = ", ".join(f"{len(b.image_grid_thw)} img/{len(b.sequence_lengths)} seq" for b in batches)
    print(
        f"\ninstrument(): {len(batches)} random microbatches ({shapes}) counted from {wrapper.captures} capture, "
        f"counting takes {per_call_us:.1f} us per microbatch: {wrapper.flops.total():,} FLOPs"
    )
    print(wrapper.flops.table(depth=1))
    return 0 if verdict.equal else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxflops", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="trace the example VLM and print its FLOPs")
    p.add_argument("--layers", type=int, default=2, help="vision blocks and text layers")
    p.add_argument("--depth", type=int, default=2, help="module depth of the table")
    p.add_argument("--microbatches", type=int, default=4)
    p.set_defaults(run=demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
