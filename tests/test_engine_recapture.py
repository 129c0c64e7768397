"""A capture in the middle of FSDP2 training leaves FSDP2 able to run its next step.

Found by a hostile probe: an evaluation call under ``torch.no_grad()`` after two FSDP2 training
steps is a new situation, so fxflops captures it. The capture's layer-reuse key hashed the values of
the tensors the layers' engine hooks reach, including FSDP2's freed all-gather buffers, through
``numpy()`` of their own storage, which made that storage non-resizable for good. FSDP2's next
all-gather then raised in the user's step. Two ranks on gloo; every rank's steps must run and be
counted.
"""

from __future__ import annotations

import torch

from test_distributed import CFG, _batch, _init, _wrap, spawn

import fxflops
from fxflops.models.tiny_gpt import TinyGPT


def _rank(rank: int, world: int, port: int, results) -> None:
    _init(rank, world, port)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    _wrap("fsdp2", model)
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:  # a new situation mid-training: captured between steps
            with torch.no_grad():
                wrapper(_batch(rank, step))
        loss = wrapper(_batch(rank, step)).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        wrapper.flops.step()
    results[rank] = (wrapper.flops.uncounted, wrapper.captures)
    torch.distributed.destroy_process_group()


def test_an_evaluation_call_captured_mid_training_leaves_fsdp2_running():
    results = spawn(_rank, 2)  # a rank raising (FSDP2's all-gather) fails the spawn
    for rank in range(2):
        uncounted, captures = results[rank]
        assert uncounted == 0, rank
        assert captures >= 2, rank  # the no_grad call got its own program
