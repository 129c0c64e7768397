"""Command line (``python -m fxflops`` or the ``fxflops`` console script).

* ``fxflops demo``: the README's main command (the example VLM).
* ``fxflops report PACKAGE.MODULE:FACTORY [--dim seq=2048 ...] [--backward] [--convention megatron]
  [--depth 2] [--json out.json] [--plot out.png]``: trace the model the factory returns and print a
  per-module table (fwd, bwd, recompute, share, formula) at the example's sizes, or at the ``--dim``
  values.
* ``fxflops check PACKAGE.MODULE:FACTORY --formula NAME|MODULE:CALLABLE``: ``fxflops.verify`` a hand
  formula against the traced program and print the verdict.

``report`` and ``check`` also take a transformers ``config.json`` (or the folder holding it) in place of
a factory: the model is built from the config on the ``meta`` device, with no weights loaded (sizing a
run before it has hardware), and traced on a text example (``batch`` x ``seq``: set them with ``--dim``)
with, for a VLM, the images given as ``--image 448x448`` (repeat the option for several; laid out as
the family's processor does: ``fxflops/integrations/hf_examples.py``).

A factory is a callable returning a dict: ``model``, ``args`` (example positional inputs), and
optionally ``kwargs``, ``dims``, ``segments``, ``per_segment`` (as for ``fxflops.trace``) and
``formulas`` (name -> a function of the program's symbol names). ``fxflops.models.tiny_vlm:example``
and ``fxflops.models.tiny_gpt:example`` are built in.

Exit codes: 0 success (``check``: the formula equals the program), 1 ``check`` found a difference,
2 bad usage (unknown factory, ``--dim`` name or formula: the message lists the valid ones),
3 the model could not be traced.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import fxflops
from fxflops.conventions import PRESETS, Convention
from fxflops.analysis.paths import depth as path_depth
from fxflops.program import PHASES
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
    repeats = 100
    with torch.no_grad():  # inference calls: the situation the counting is timed in, too
        for batch in batches:
            wrapper(*batch.inputs())
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
        f"\ninstrument(): {len(batches)} random microbatches ({shapes}) counted from {wrapper.captures} capture(s), "
        f"counting takes {per_call_us:.1f} us per microbatch: {wrapper.flops.total():,} FLOPs"
    )
    print(wrapper.flops.table(depth=1))
    return 0 if verdict.equal else 1


class UsageError(Exception):
    """A command-line mistake: exit code 2 with this message."""


def load_factory(spec: str, images: list[str] = ()) -> dict:
    """``package.module:factory`` -> the dict the factory returns; a ``config.json`` path (or its
    folder) and the ``--image`` sizes -> :func:`config_example` (see the module docstring)."""
    if spec.endswith(".json") or Path(spec).is_dir():
        return config_example(Path(spec), [image_size(image) for image in images])
    if images:
        raise UsageError("--image applies to a config.json (a factory builds its own example)")
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"expected PACKAGE.MODULE:FACTORY, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot load factory {spec!r}: {exc}") from exc
    example = factory()
    if not isinstance(example, dict) or "model" not in example or "args" not in example:
        raise UsageError(f"factory {spec!r} must return a dict with at least 'model' and 'args'")
    return example


def config_example(path: Path, images: list[tuple[int, int]] = ()) -> dict:
    """A transformers model from a local ``config.json``, built on the ``meta`` device (no weights),
    with a training example of one sequence: 16 text tokens whose ``batch`` and ``seq`` are
    symbols, and ``images`` (width, height) laid out as the family's processor lays them out
    (``fxflops/integrations/hf_examples.py``)."""
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file():
        raise UsageError(f"no config.json at {path}")
    import transformers

    from fxflops.integrations.hf_examples import example_call

    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    vision = getattr(config, "vision_config", None) is not None
    builder = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    try:
        kwargs = example_call(config, list(images))
    except ValueError as exc:
        raise UsageError(f"{folder / 'config.json'}: {exc}") from exc
    try:
        with torch.device("meta"):
            model = builder.from_config(config)
    except ValueError as exc:
        kind = "vision-language" if vision else "causal language"
        raise UsageError(f"{folder / 'config.json'}: not a {kind} model transformers can build ({exc})") from exc
    return {"model": model.eval(), "args": (), "kwargs": kwargs}


def image_size(text: str) -> tuple[int, int]:
    """``--image WIDTHxHEIGHT`` in pixels."""
    width, _, height = text.lower().partition("x")
    if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise UsageError(f"bad --image {text!r}: use WIDTHxHEIGHT in pixels, e.g. 448x448")
    return int(width), int(height)


def trace_example(example: dict, backward: bool) -> fxflops.Program:
    """Trace the factory's model with a progress indicator on stderr."""
    console = Console(stderr=True)
    with console.status(f"tracing {type(example['model']).__name__} ..."):
        return fxflops.trace(
            example["model"],
            tuple(example["args"]),
            example.get("kwargs"),
            dims=example.get("dims"),
            segments=example.get("segments"),
            per_segment=example.get("per_segment"),
            backward=backward,
        )


def symbol_values(program: fxflops.Program, example: dict, dims: list[str]) -> dict[str, int]:
    """The example inputs' symbol values, overridden by ``--dim name=value``."""
    args, kwargs = tuple(example["args"]), example.get("kwargs") or {}
    values = dict(zip(map(str, program.all_symbols), program.values(*args, **kwargs)))
    values = {name: int(v) for name, v in values.items()}
    valid = [str(s) for s in program.symbols]
    for item in dims:
        name, _, value = item.partition("=")
        if name not in values or not value.lstrip("-").isdigit():
            raise UsageError(f"bad --dim {item!r}: use NAME=INT with NAME one of {valid}")
        values[name] = int(value)
    return values


def convention_named(name: str) -> Convention:
    if name not in PRESETS:
        raise UsageError(f"unknown convention {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def report_rows(program: fxflops.Program, values: dict[str, int], depth: int, convention: Convention) -> list[dict]:
    """One row per module: FLOPs per phase, share, formula (the JSON ``modules`` schema)."""
    phases = {ph: program.breakdown(depth, ph, convention, **values) for ph in PHASES}
    total = sum(phases[ph][""] for ph in PHASES) or 1
    rows = []
    for path in program.modules(depth):
        flops = {ph: phases[ph][path] for ph in PHASES}
        if any(flops.values()):
            rows.append(
                {"module": path or "<model>", **flops, "share": sum(flops.values()) / total,
                 "formula": str(program.formula(path, convention=convention))}
            )
    return rows


def report(args: argparse.Namespace) -> int:
    example = load_factory(args.factory, args.image)
    convention = convention_named(args.convention)
    program = trace_example(example, args.backward)
    values = symbol_values(program, example, args.dim)
    rows = report_rows(program, values, args.depth, convention)
    table = Table(title=f"FLOPs at {', '.join(f'{k}={v}' for k, v in values.items() if k in map(str, program.symbols))}",
                  caption=convention.describe())
    for column in ("module", "fwd", "bwd", "recompute", "share", "formula"):
        table.add_column(column, justify="left" if column in ("module", "formula") else "right")
    for row in rows:
        depth = 0 if row["module"] == "<model>" else path_depth(row["module"])
        table.add_row("  " * depth + row["module"].rsplit(".", 1)[-1], *(f"{row[ph]:,}" for ph in PHASES), f"{100 * row['share']:.1f}%", row["formula"])
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    for note in program.notes:
        print(f"note: {note}")
    if args.peak is not None or args.device is not None:
        print(step_time(rows[0] if rows else {}, args.peak, args.device, args.mfu))
    if args.json:
        document = {
            "convention": convention.describe(),
            "symbols": program.describe_symbols(),
            "values": values,
            "total": program.total(convention=convention, **values),
            "modules": rows,
            "guards": [str(g) for g in program.guards],
            "unsupported": [str(u) for u in program.unsupported],
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=2)
    if args.plot:
        from fxflops.plot import plot_breakdown

        plot_breakdown(program, values, depth=args.depth, convention=convention, path=args.plot)
    return 0


def step_time(root: dict, peak: float | None, device: str | None, mfu: float) -> str:
    """The time one call of the reported sizes takes on a device at ``mfu``: model FLOPs (forward +
    backward; recompute is not useful work) / (peak FLOP/s x MFU)."""
    from fxflops.peaks import lookup_peak

    if not 0 < mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], not {mfu}")
    source = "given with --peak"
    if peak is None:
        peak, source = lookup_peak(device, torch.bfloat16)
        if peak is None:
            raise UsageError(f"no peak FLOP/s for --device {device!r}: {source}; give --peak FLOPS")
    model_flops = root.get("fwd", 0) + root.get("bwd", 0)
    seconds = model_flops / (peak * mfu)
    return (
        f"step time at {100 * mfu:.0f}% MFU on {device or 'the given peak'} ({peak / 1e12:,.1f} TFLOP/s bf16 dense, {source}): "
        f"{seconds * 1e3:,.3f} ms per call ({model_flops:,} model FLOPs)"
    )


def check(args: argparse.Namespace) -> int:
    example = load_factory(args.factory, args.image)
    convention = convention_named(args.convention)
    formulas = example.get("formulas") or {}
    if args.formula in formulas:
        formula = formulas[args.formula]
    elif ":" in args.formula:
        module_name, _, name = args.formula.partition(":")
        try:
            formula = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"cannot load formula {args.formula!r}: {exc}") from exc
    else:
        raise UsageError(f"unknown formula {args.formula!r}; the factory offers {sorted(formulas)} (or give MODULE:CALLABLE)")
    program = trace_example(example, args.backward)
    try:
        verdict = fxflops.verify(program, formula, convention=convention)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(verdict)
    return 0 if verdict.equal else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxflops", description="Exact FLOPs of PyTorch models from their traced graph.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="trace the example VLM and print its FLOPs")
    p.add_argument("--layers", type=int, default=2, help="vision blocks and text layers")
    p.add_argument("--depth", type=int, default=2, help="module depth of the table")
    p.add_argument("--microbatches", type=int, default=4)
    p.set_defaults(run=demo)
    for name, run, help_text in (
        ("report", report, "per-module FLOPs table of a model"),
        ("check", check, "verify a hand formula against the traced model"),
    ):
        p = commands.add_parser(name, help=help_text)
        p.add_argument("factory", help="PACKAGE.MODULE:FACTORY returning {'model', 'args', ...}, or a transformers config.json")
        p.add_argument("--backward", action="store_true", help="capture the backward too (training FLOPs)")
        p.add_argument("--convention", default="flopcounter", help=f"one of {sorted(PRESETS)}")
        p.add_argument("--image", action="append", default=[], metavar="WxH",
                       help="with a config.json: an image of the example, in pixels (repeat for several)")
        p.set_defaults(run=run)
        if name == "report":
            p.add_argument("--dim", action="append", default=[], metavar="NAME=INT", help="a symbol's value")
            p.add_argument("--depth", type=int, default=2)
            p.add_argument("--json", metavar="PATH", help="write the report as JSON")
            p.add_argument("--plot", metavar="PATH", help="write the per-module breakdown as a PNG")
            p.add_argument("--device", help="a device name (H100, B200, ...): print the step time at --mfu on it")
            p.add_argument("--peak", type=float, help="peak FLOP/s per device (instead of --device)")
            p.add_argument("--mfu", type=float, default=0.4, help="the MFU of --device/--peak step times (default 0.4)")
        else:
            p.add_argument("--formula", required=True, help="a formula the factory offers, or MODULE:CALLABLE")
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"fxflops: {exc}", file=sys.stderr)
        return 2
    except fxflops.CaptureError as exc:
        print(f"fxflops: could not trace the model: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
