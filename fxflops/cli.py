"""Command line: ``python -m fxflops demo`` (also the ``fxflops`` console script)."""

from __future__ import annotations

import argparse
import sys
import time

import sympy
import torch

import fxflops
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT, forward_flops_formula
from fxflops.report import human


def demo(args: argparse.Namespace) -> int:
    """Trace the built-in TinyGPT once, print its per-module table, formula and a formula check."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=args.layers)
    model = TinyGPT(cfg)
    example = torch.randint(0, cfg.vocab, (2, 64))
    start = time.perf_counter()
    program = fxflops.trace(model, (example,), dims={"input_ids": {0: "batch", 1: "seq"}})
    print(f"traced TinyGPT ({cfg.layers} layers) once in {time.perf_counter() - start:.2f} s: {program}\n")
    print(program.table(depth=args.depth, batch=args.batch, seq=args.seq))
    print(f"\nclosed form: FLOPs(batch, seq) = {program.formula()}")

    batch, seq = program.symbols
    hand = forward_flops_formula(cfg, batch, seq)
    difference = sympy.expand(program.formula() - hand)
    verdict = "equal" if difference == 0 else f"DIFFER by {difference}"
    print(f"hand formula 2·N_matmul·b·s + 4·L·b·heads·s²·head_dim = {sympy.expand(hand)}: {verdict}")

    wrapper = fxflops.instrument(model, dims={"input_ids": {0: "batch", 1: "seq"}})
    shapes = [(1, 37), (4, 128), (2, 301), (8, 16)]
    with torch.no_grad():
        for b, s in shapes:
            wrapper(torch.randint(0, cfg.vocab, (b, s)))
    print(
        f"\ninstrument(): {len(shapes)} microbatches {shapes} counted from one capture "
        f"({wrapper.captures}): {wrapper.flops.total():,} FLOPs = {human(wrapper.flops.total())}"
    )
    return 0 if difference == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxflops", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="trace the built-in example model and print its FLOPs")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--depth", type=int, default=3)
    p.set_defaults(run=demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
