"""Counting cost of generation: ``wrapper.generate`` versus the plain model's ``generate``.

Run: ``python benchmarks/generation_overhead.py``. A tiny transformers Llama (random weights) generates
32 tokens greedily from a 3 x 24 left-padded prompt. Rounds alternate between the plain model's
``generate``, the instrumented wrapper's and the plain one under FlopCounterMode; medians are compared.
fxflops' own work per forward (looking the program up and adding the count) is timed inside the real
``generate`` calls. Target (issue 18): <= 10 us of counting per decode step.
"""

from __future__ import annotations

import argparse
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

    own = [0.0]

    def timed(method):
        def run(*call):
            start = time.perf_counter()
            try:
                return method(*call)
            finally:
                own[0] += time.perf_counter() - start
        return run

    start = time.perf_counter()
    wrapper.generate(**generation)  # the captures: prefill and decode programs
    capture_s = time.perf_counter() - start
    wrapper._look_up, wrapper._add = timed(wrapper._look_up), timed(wrapper._add)
    wrapper.flops.reset()
    own[0] = 0.0

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
    forwards = wrapper.flops.calls
    per_forward = own[0] / forwards
    p, c, m = statistics.median(plain), statistics.median(counted), statistics.median(measured)
    steps = args.new_tokens  # one prefill + (new tokens - 1) decode steps per generate call
    print(f"tiny Llama ({args.layers} layers, hidden 64), generate 3 x 24 prompt + {args.new_tokens} tokens, median of {args.rounds} rounds, CPU")
    print(f"  first wrapper.generate (prefill + decode captures)  {capture_s:8.2f} s")
    print(f"  plain generate                                      {p * 1e3:8.2f} ms  ({p / steps * 1e6:,.0f} us per forward)")
    print(f"  wrapper.generate                                    {c * 1e3:8.2f} ms  (ratio {c / p:.3f})")
    print(f"  under FlopCounterMode                               {m * 1e3:8.2f} ms  (ratio {m / p:.3f})")
    print(f"  fxflops' own work per forward (timed inside generate) {per_forward * 1e6:6.2f} us  (target <= 10 us per decode step)")
    print(f"  FlopCounterMode added / fxflops' own work          {(m - p) / steps / per_forward:8,.0f}x")
    print(
        f"  counted per generate: prefill {wrapper.flops.total(phase='prefill') // args.rounds:,}  "
        f"decode {wrapper.flops.total(phase='decode') // args.rounds:,} FLOPs, "
        f"{wrapper.flops.generated_tokens // args.rounds} tokens"
    )


if __name__ == "__main__":
    main()
