"""Counting cost of ``instrument()`` vs FlopCounterMode and the plain forward; capture vs torch.export.

Run: ``python benchmarks/overhead.py``. Prints medians of interleaved runs (plain forward,
FlopCounterMode forward, fxflops counting of the same call, in turn each round) and their ratios; the
per-call cost split into its parts (the call's situation: call key, i.e. the generated test a known
situation is recognised by, modes, model state; binding and guards; the meter) for a forward and for
a training call, at 4 and 24 layers; the cost of a call
refused after its layout's first failed capture; then capture time of ``fxflops.trace`` and
``torch.export`` (non-strict, dynamic batch and seq) at 2, 8 and 24 layers. Targets: counting <= 5 us
per LM call with call identity (issue 13; <= 20 us in issue 2), >= 500x cheaper than FlopCounterMode's
added time, a refused call <= 50 us, capture <= 0.15 s per transformer layer. Counting is timed
in a loop (warm) and once right after each forward (in situ: the forward leaves the processor's
caches holding its own code and data, and the first Python after it runs several times slower; an
empty call timed so is printed beside it).
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
        samples: dict[str, list[float]] = {"plain": [], "flopcounter": [], "fxflops": [], "in_situ": [], "empty_in_situ": []}
        for _ in range(rounds):
            samples["plain"].append(_seconds(plain))
            samples["in_situ"].append(_seconds(count))  # once, right after a forward: the caches a real step leaves
            plain()
            samples["empty_in_situ"].append(_seconds(lambda: None))
            samples["flopcounter"].append(_seconds(under_flopcounter))
            # one counting call is ~microseconds: time 100 back-to-back and divide
            samples["fxflops"].append(_seconds(lambda: [count() for _ in range(100)]) / 100)
    med = {k: statistics.median(v) for k, v in samples.items()}
    med["flopcounter_added"] = med["flopcounter"] - med["plain"]
    return med


def _per_call(fn, calls: int = 2000, rounds: int = 7) -> float:
    """Median over rounds of the mean time of ``calls`` back-to-back calls, in seconds."""
    return statistics.median(_seconds(lambda: [fn() for _ in range(calls)]) / calls for _ in range(rounds))


def cost_parts(layers: int, batch: int, seq: int, training: bool) -> dict[str, float]:
    """The per-call cost of ``wrapper._count`` and its parts, for a forward (no grad) or a training
    call (grad enabled: the model state includes which parameters require grad)."""
    from fxflops.situation import mode_key

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(layers=layers))
    wrapper = fxflops.instrument(model, dims={"input_ids": {0: "batch", 1: "seq"}}, backward=training)
    ids = torch.randint(0, model.cfg.vocab, (batch, seq))
    args, kwargs = (ids,), {}
    with torch.set_grad_enabled(training):
        wrapper(ids)
        wrapper(ids)  # the second call generates the call key's test of this situation (call_keys.py)
        same_key = wrapper._recent[(len(args), tuple(kwargs), None)][0][0]  # layout: positional count, keywords, roots
        program = wrapper.program
        values = program.binder.values(args, kwargs)
        monomials = program.monomials(*values)
        parts = {
            "total": _per_call(lambda: wrapper._count(args, kwargs, training)),
            "call key": _per_call(lambda: same_key(args, kwargs)),
            "modes": _per_call(mode_key),
            "model state": _per_call(program.state.matches),
            "binding + guards": _per_call(lambda: program.within_guards(*program.binder.values(args, kwargs))),
            "monomials + meter": _per_call(lambda: wrapper.flops.add(program, program.monomials(*values), training)),
        }
    parts["guards"] = len(program.state.guards) + (len(program.state.requires_grad) if training else 0)
    del monomials
    return parts


class DataDependent(torch.nn.Module):
    """Reads tensor values to choose its rows: no symbolic trace exists, every call is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[: int((x > 0).sum()) % x.shape[0] + 1])


def refused_call_cost() -> tuple[float, float]:
    """(seconds of the first call: the failed capture; seconds per later refused call, other shapes)."""
    import warnings

    wrapper = fxflops.instrument(DataDependent())
    inputs = [torch.randn(rows, 64) for rows in range(2, 40)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _seconds(lambda: wrapper._prepare((inputs[0],), {}) and _try(wrapper, inputs[0]))
        later = _per_call(lambda: [_try(wrapper, x) for x in inputs[1:]], calls=50) / len(inputs[1:])
    return first, later


def _try(wrapper, x) -> None:
    try:
        wrapper._count((x,), {})
    except fxflops.FxFlopsError:
        pass


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
    print(
        f"  fxflops counting right after a forward {med['in_situ'] * us:8.2f} us  "
        f"(in situ; an empty call timed so: {med['empty_in_situ'] * us:.2f} us)"
    )
    print(f"  FlopCounterMode added / fxflops counting = {med['flopcounter_added'] / med['fxflops']:,.0f}x  (target >= 500x)")
    print(f"  fxflops counting / plain forward        = {100 * med['fxflops'] / med['plain']:.4f} %")

    print("\nper-call cost with call identity (median of 7 rounds of 2,000 calls), TinyGPT batch 4 x seq 256")
    names = ("call key", "modes", "model state", "binding + guards", "monomials + meter")
    print(f"  {'call':<22} {'total':>8} " + " ".join(f"{n:>17}" for n in names) + f" {'state guards':>13}")
    for layers in (args.layers, 24):
        for training in (False, True):
            parts = cost_parts(layers, args.batch, args.seq, training)
            label = f"{layers} layers, {'training' if training else 'forward'}"
            print(f"  {label:<22} {parts['total'] * us:6.2f}us " + " ".join(f"{parts[n] * us:15.2f}us" for n in names) + f" {parts['guards']:>13}")
    print("  target: <= 5 us per LM call (TinyGPT 4 layers); the model state check grows with the attributes")
    print("  the trace read and, for training calls, with the parameters (whose requires_grad it checks)")

    first, later = refused_call_cost()
    print("\na call layout fxflops cannot capture (data-dependent rows), other shapes on every call")
    print(f"  first call (the failed capture)  {first:10.3f} s")
    print(f"  each later call, refused at once {later * us:10.2f} us  (target <= 50 us)")

    print("\ncapture time (trace once) vs torch.export(strict=False, dynamic batch & seq)")
    print(f"  {'layers':>6}  {'fxflops.trace':>13}  {'per layer':>9}  {'torch.export':>12}  {'export/trace':>12}")
    for layers, t_fx, t_export in capture_times(args.capture_layers):
        print(f"  {layers:>6}  {t_fx:>11.2f} s  {t_fx / layers:>7.3f} s  {t_export:>10.2f} s  {t_export / t_fx:>11.1f}x")
    print("  target: <= 0.15 s per transformer layer")


if __name__ == "__main__":
    main()
