"""Train the example VLM on synthetic multimodal batches and log FLOPs, TFLOP/s and MFU as you go.

Run: ``python examples/train.py [--steps 200] [--log-every 50] [--accumulate 2] [--peak-tflops X]``.
Every microbatch has a random number of images (1-8), video frames (1-3), resolutions and packed text
sequences (1-32); ``fxflops.instrument`` counts each one exactly from one capture. Every N steps it
logs the loss, TFLOP/s per GPU, MFU (on a CPU there is no peak to compare with: it says so unless you
pass ``--peak-tflops``) and the per-module breakdown (vision blocks / merger / language model / head).
Runs on a CPU in well under a minute with the default sizes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
import torch.nn.functional as F

import fxflops
from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch


def progress(step: int, total: int, loss: float, width: int = 30) -> None:
    done = int(width * step / total)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total} loss {loss:.3f}")
    sys.stdout.flush()


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """Cross-entropy of each token predicting the next one, image tokens not predicted."""
    targets = input_ids[:, 1:].masked_fill(input_ids[:, 1:] == image_token_id, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--accumulate", type=int, default=2, help="microbatches per optimizer step")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: the table)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = VLMConfig()
    model = fxflops.instrument(
        TinyVLM(cfg),
        dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}},
        segments={"cu_seqlens": "text", "image_grid_thw": "frames"},
        backward=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    device = next(model.parameters()).device
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        for _ in range(args.accumulate):
            batch = random_batch(cfg, rng)
            logits = model(*batch.inputs())
            loss = next_token_loss(logits, batch.input_ids, cfg.image_token_id) / args.accumulate
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.flops.step()
        progress(step, args.steps, loss.item() * args.accumulate)
        if step % args.log_every == 0:
            report = model.flops.report(depth=2, peak_flops=peak, device=device, dtype=torch.float32, tokens="tokens", images="image_grid_thw_0")
            print(f"\nstep {step}: loss {loss.item() * args.accumulate:.3f}; {report}")
    print(f"\ntrained {args.steps} steps in {time.perf_counter() - start:.1f} s ({model.captures} capture)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
