"""Counting cost of generation: ``wrapper.generate`` versus the plain model's ``generate``.

Run: ``python benchmarks/generation_overhead.py``. A tiny transformers Llama (random weights) generates
32 tokens greedily from a 3 x 24 left-padded prompt. Rounds alternate between the plain model's
``generate``, the instrumented wrapper's and the plain one under FlopCounterMode; medians are compared.
fxflops' own work per forward (looking the program up and adding the count) is timed inside the real
``generate`` calls (median per decode step and per prefill), and for one decode call repeated back to
back (hot caches: the cost of the code itself, without the model's step evicting it). Target
(issue 18): <= 10 us of counting per decode step.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    wrapper = fxflops.instrument(model)
    ids = torch.randint(1, 512, (3, 24))
    mask = torch.ones_like(ids)
    mask[1:, :4] = 0
    generation = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)

    per_forward: list[list[float]] = []  # [look-up, add] seconds of each forward, in call order
    decode_call: list = []

    def timed(method, first: bool):
        def run(*call):
            start = time.perf_counter()
            try:
                return method(*call)
            finally:
                elapsed = time.perf_counter() - start
                if first:
                    per_forward.append([elapsed, 0.0])
                    if len(per_forward) == 2:  # a decode call, as it was before the model grew its cache
                        decode_call[:] = [copy.deepcopy(call)]
                else:
                    per_forward[-1][1] = elapsed
        return run

    start = time.perf_counter()
    wrapper.generate(**generation)  # the captures: prefill and decode programs
    capture_s = time.perf_counter() - start
    look_up, add = wrapper._look_up, wrapper._add
    wrapper._look_up, wrapper._add = timed(look_up, True), timed(add, False)
    wrapper.flops.reset()

    def run(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def under_flop_counter() -> None:
        with FlopCounterMode(display=False):
            model.generate(**generation)

    plain, counted, measured = [], [], []
    for _ in range(args.rounds):
        plain.append(run(lambda: model.generate(**generation)))
        counted.append(run(lambda: wrapper.generate(**generation)))
        measured.append(run(under_flop_counter))
    own = [a + b for a, b in per_forward]
    prefill_own = statistics.median(own[:: args.new_tokens])
    decode_own = statistics.median([t for i, t in enumerate(own) if i % args.new_tokens])
    wrapper._look_up, wrapper._add = look_up, add
    totals = (wrapper.flops.total(phase="prefill"), wrapper.flops.total(phase="decode"), wrapper.flops.generated_tokens)
    hot = _hot_decode_step(wrapper, *decode_call[0])
    p, c, m = statistics.median(plain), statistics.median(counted), statistics.median(measured)
    steps = args.new_tokens  # one prefill + (new tokens - 1) decode steps per generate call
    print(f"tiny Llama ({args.layers} layers, hidden 64), generate 3 x 24 prompt + {args.new_tokens} tokens, median of {args.rounds} rounds, CPU")
    print(f"  first wrapper.generate (prefill + decode captures)  {capture_s:8.2f} s")
    print(f"  plain generate                                      {p * 1e3:8.2f} ms  ({p / steps * 1e6:,.0f} us per forward)")
    print(f"  wrapper.generate                                    {c * 1e3:8.2f} ms  (ratio {c / p:.3f})")
    print(f"  under FlopCounterMode                               {m * 1e3:8.2f} ms  (ratio {m / p:.3f})")
    print(f"  fxflops' own work per decode step, inside generate {decode_own * 1e6:7.2f} us  (median; target <= 10 us)")
    print(f"  ... the same decode call repeated alone (hot caches) {hot * 1e6:7.2f} us")
    print(f"  fxflops' own work per prefill, inside generate      {prefill_own * 1e6:7.2f} us")
    print(f"  FlopCounterMode added per forward / fxflops' per decode step {(m - p) / steps / decode_own:5,.0f}x")
    print(
        f"  counted per generate: prefill {totals[0] // args.rounds:,}  decode {totals[1] // args.rounds:,} FLOPs, "
        f"{totals[2] // args.rounds} tokens"
    )


def _hot_decode_step(wrapper, args: tuple, kwargs: dict, repeats: int = 2000) -> float:
    """Seconds of fxflops' own work for one decode call repeated back to back (the count added
    ``repeats`` times is taken back out of the meter)."""
    with torch.no_grad():
        call_args, call_kwargs, found = wrapper._look_up(args, kwargs)
        start = time.perf_counter()
        for _ in range(repeats):
            call_args, call_kwargs, found = wrapper._look_up(args, kwargs)
            wrapper._add(found, None, "decode")
        return (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    main()
