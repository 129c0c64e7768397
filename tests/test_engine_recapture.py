"""A capture in the middle of training leaves the engine able to run its next step (FSDP2, tensor
parallel, pipelining), with the user's losses unchanged.

Found by a hostile probe: an evaluation call under ``torch.no_grad()`` after two FSDP2 training
steps is a new situation, so fxflops captures it. The capture's layer-reuse key hashed the values of
the tensors the layers' engine hooks reach, including FSDP2's freed all-gather buffers, through
``numpy()`` of their own storage, which made that storage non-resizable for good. FSDP2's next
all-gather then raised in the user's step. Two ranks on gloo; every rank's steps must run and be
counted. The same evaluation call between steps of tensor-parallel training and of an interleaved
pipeline schedule (``schedule.eval`` under ``no_grad``) is captured too, and must leave the losses
bit-identical to uninstrumented training and every call counted.
"""

from __future__ import annotations

import pytest
import torch
from reference import flop_counter_call
from test_distributed import CFG, LAYERS, MICROBATCHES, Layer, _batch, _init, _wrap, spawn, tensor_parallel_gpt
from torch import nn

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


@pytest.mark.long
def test_an_evaluation_call_captured_mid_training_leaves_fsdp2_running():
    results = spawn(_rank, 2)  # a rank raising (FSDP2's all-gather) fails the spawn
    for rank in range(2):
        uncounted, captures = results[rank]
        assert uncounted == 0, rank
        assert captures >= 2, rank  # the no_grad call got its own program


def _tensor_parallel_rank(rank: int, world: int, port: int, results) -> None:
    _init(rank, world, port)
    results[rank] = (_train_tensor_parallel(world, False), _train_tensor_parallel(world, True))
    torch.distributed.destroy_process_group()


def _train_tensor_parallel(world: int, instrumented: bool) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    model = tensor_parallel_gpt(init_device_mesh("cpu", (world,)))
    step_module = fxflops.instrument(model, backward=True, strict=True) if instrumented else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        if step == 2:  # a new situation mid-training: captured between steps
            with torch.no_grad():
                losses.append(step_module(_batch(0, 9)).float().mean().item())
        loss = step_module(_batch(0, step)).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if instrumented:
            step_module.flops.step()
    return losses, (step_module.captures, step_module.flops.uncounted) if instrumented else None


@pytest.mark.long  # two ranks, two trainings each
def test_an_evaluation_call_captured_mid_training_leaves_tensor_parallel_training_unchanged():
    results = spawn(_tensor_parallel_rank, 2)
    for rank in range(2):
        (plain, _), (instrumented, (captures, uncounted)) = results[rank]
        assert instrumented == plain, rank  # bit-identical losses, evaluation included
        assert captures == 2 and uncounted == 0, rank


def _pipeline_rank(rank: int, world: int, port: int, results) -> None:
    _init(rank, world, port)
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    layers = [Layer() for _ in range(LAYERS)]
    chunks, per_chunk = [rank, rank + world], LAYERS // (2 * world)
    meter = fxflops.Meter()
    wrappers = [
        fxflops.instrument(nn.Sequential(*layers[c * per_chunk : (c + 1) * per_chunk]), backward=True, strict=True, meter=meter)
        for c in chunks
    ]
    stages = [PipelineStage(w, c, 2 * world, torch.device("cpu")) for w, c in zip(wrappers, chunks)]
    runner = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=lambda out, target: out.sum())
    x, target = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 5, 16)
    first = (x,) if rank == 0 else ()
    for step in range(4):
        if step == 2:  # an evaluation pass between steps: forward only, no grad, its own program
            with torch.no_grad():
                runner.eval(*first, target=target)
        runner.step(*first, target=target)
        meter.step()
    results[rank] = ([w.captures for w in wrappers], meter.report(elapsed_s=1.0, peak_flops=1e12).hardware_flops)
    torch.distributed.destroy_process_group()


@pytest.mark.long
def test_an_evaluation_pass_captured_mid_training_leaves_the_pipeline_running():
    results = spawn(_pipeline_rank, 2)
    torch.manual_seed(0)
    whole = nn.Sequential(*[Layer() for _ in range(LAYERS)])
    microbatches = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(1)).chunk(MICROBATCHES)
    training = sum(flop_counter_call(whole, (mb,), {}, backward=True) for mb in microbatches)
    evaluation = sum(flop_counter_call(whole, (mb,), {}, backward=False) for mb in microbatches)
    for rank in range(2):
        captures, counted = results[rank]
        assert captures == [2, 2], rank  # each stage: the training program and the evaluation one
        assert counted == 4 * training + evaluation, rank
