"""Distributed engines on CPU with gloo: each rank counts what it computes, the engine is untouched
(issue 15). Ranks are spawned by the test on localhost; every spawn is bounded in time.

- FSDP2 (``fully_shard`` per layer and at the root, bf16 ``MixedPrecisionPolicy``) and DDP, each in
  both wrapping orders, and FSDP2 under ``torch.compile`` in both orders, 3 training steps with a different batch per rank: every rank's count equals
  FlopCounterMode on the unsharded model for its batches, the report's global count is their sum, and
  losses and parameters equal those of the same run without fxflops.
- Tensor parallel, TP = 2 on TinyGPT (column/row-parallel attention, MLP and head): each rank counts
  its shards, the ranks sum to the unsharded model's count, and losses equal the uninstrumented run;
  TP = 2 inside 2 FSDP2 replicas on 4 ranks: the global count is the replicas' work, once each.
- Pipelining: ``Schedule1F1B`` on 2 stages and ``ScheduleInterleaved1F1B`` with 2 virtual chunks per
  rank: every layer once per microbatch (the stages' one-time shape inference is not a microbatch).

References are computed in the test process: FlopCounterMode (CPU attention counted) on an
unsharded copy of the model with the same batches.
"""

from __future__ import annotations

import os
import socket
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fxflops
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT
from reference import flop_counter_call

CFG = GPTConfig(vocab=100, hidden=32, heads=4, kv_heads=2, ffn=48, layers=2)
STEPS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(fn, world: int, *args, timeout: float = 240.0) -> dict:
    """Run ``fn(rank, world, port, results, *args)`` on ``world`` processes; their ``results``."""
    results = mp.Manager().dict()
    context = mp.start_processes(fn, args=(world, _free_port(), results, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s")
    return dict(results)


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.simplefilter("ignore")


def _batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, CFG.vocab, (1 + rank, 5 + step + 2 * rank), generator=generator)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _train_steps(step_module: nn.Module, parameters, batch_rank: int, meter: fxflops.Meter | None = None) -> list[float]:
    """``STEPS`` SGD steps of ``step_module`` on the batches of ``batch_rank``; their losses."""
    optimizer = torch.optim.SGD(parameters, lr=0.5)
    losses = []
    for step in range(STEPS):
        loss = step_module(_batch(batch_rank, step)).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if meter is not None:
            meter.step()
    return losses


def _wrap(engine: str, module: nn.Module) -> nn.Module:
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(module)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in module.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    return module


def _engine_rank(rank: int, world: int, port: int, results, engine: str, order: str) -> None:
    """3 training steps of TinyGPT under ``engine`` without fxflops, then the same with it (``order``:
    see :func:`_train`)."""
    _init(rank, world, port)
    plain = "compiled" if order.startswith("compile") else None
    results[rank] = (_train(rank, engine, plain), _train(rank, engine, order))
    dist.destroy_process_group()


def _train(rank: int, engine: str, order: str | None) -> tuple:
    """``order``: None (no fxflops), "instrument_first", "wrap_first"; "compile_first"
    (``instrument(torch.compile(wrapped))``) and "compile_last" (``torch.compile(instrument(wrapped))``),
    whose run without fxflops (order "compiled") is ``torch.compile(wrapped)``."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    wrapper = fxflops.instrument(model, backward=True, strict=True) if order == "instrument_first" else None
    wrapped = _wrap(engine, wrapper if engine == "ddp" and wrapper is not None else model)
    if order in ("compiled", "compile_first"):
        wrapped = torch.compile(wrapped, backend="aot_eager", dynamic=True)
    if order in ("wrap_first", "compile_first", "compile_last"):
        wrapper = fxflops.instrument(wrapped, backward=True, strict=True)
    if order == "compile_last":
        step_module = torch.compile(wrapper, backend="aot_eager", dynamic=True)
    elif order is None or order == "compiled" or engine == "ddp" and order == "instrument_first":
        step_module = wrapped
    else:
        step_module = wrapper
    losses = _train_steps(step_module, step_module.parameters(), rank, wrapper.flops if wrapper is not None else None)
    parameters = [_local(p).detach().float().clone() for p in step_module.parameters()]
    counted = None
    if wrapper is not None:
        local = wrapper.flops.total()
        report = wrapper.flops.report(elapsed_s=1.0, peak_flops=1e12)
        counted = (local, report.hardware_flops, report.world_size, wrapper.captures, report.uncounted)
    return losses, parameters, counted


def _unsharded_reference(world: int) -> list[int]:
    """FlopCounterMode's count of each rank's 3 training steps on the unsharded model."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    return [sum(flop_counter_call(model, (_batch(rank, step),), {}, backward=True) for step in range(STEPS)) for rank in range(world)]


@pytest.mark.parametrize(
    ("engine", "order"),
    [
        ("fsdp2", "instrument_first"), pytest.param("fsdp2", "wrap_first", marks=pytest.mark.long),
        ("ddp", "instrument_first"), ("ddp", "wrap_first"),
        *(pytest.param("fsdp2", order, marks=pytest.mark.long) for order in ("compile_first", "compile_last")),
    ],
)
def test_data_parallel_engines_count_each_rank_and_stay_untouched(engine, order):
    world = 2
    runs = spawn(_engine_rank, world, engine, order)
    expected = _unsharded_reference(world)
    for rank in range(world):
        plain, (losses, parameters, (local, global_, world_size, captures, uncounted)) = runs[rank]
        assert losses == plain[0], (engine, order, rank)  # the engine trains exactly as without fxflops
        assert all(torch.equal(a, b) for a, b in zip(parameters, plain[1])), (engine, order, rank)
        assert local == expected[rank], (engine, order, rank)
        assert global_ == sum(expected) and world_size == world and uncounted == 0
        assert captures == 1


TP_PLAN_LAYER = {
    "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def _tensor_parallel_rank(rank: int, world: int, port: int, results) -> None:
    _init(rank, world, port)
    results[rank] = (_train_tensor_parallel(world, False), _train_tensor_parallel(world, True))
    dist.destroy_process_group()


def tensor_parallel_gpt(mesh) -> TinyGPT:
    """A seeded TinyGPT with every attention and MLP projection and the head sharded over ``mesh``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = TinyGPT(CFG)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {f"layers.{i}.{path}": styles[kind]() for i in range(CFG.layers) for path, kind in TP_PLAN_LAYER.items()}
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return parallelize_module(model, mesh, plan)


def _train_tensor_parallel(world: int, instrumented: bool) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    model = tensor_parallel_gpt(init_device_mesh("cpu", (world,)))
    step_module = fxflops.instrument(model, backward=True, strict=True) if instrumented else model
    losses = _train_steps(step_module, model.parameters(), 0)  # tensor-parallel ranks see the same batch
    counted = None
    if instrumented:
        local = step_module.flops.total()
        counted = (local, step_module.flops.report(elapsed_s=1.0, peak_flops=1e12).hardware_flops)
    return losses, counted


def test_tensor_parallel_ranks_count_their_shards():
    world = 2
    runs = spawn(_tensor_parallel_rank, world)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    unsharded = sum(flop_counter_call(model, (_batch(0, step),), {}, backward=True) for step in range(STEPS))
    locals_ = [runs[rank][1][1][0] for rank in range(world)]
    assert sum(locals_) == unsharded and locals_[0] == locals_[1] == unsharded // 2  # every matmul sharded in two
    for rank in range(world):
        plain, (losses, (_, global_)) = runs[rank]
        assert losses == plain[0]
        assert global_ == unsharded  # the report's global sum: the replica's work, once


def _two_dimensional_rank(rank: int, world: int, port: int, results) -> None:
    _init(rank, world, port)
    results[rank] = (_train_two_dimensional(rank, False), _train_two_dimensional(rank, True))
    dist.destroy_process_group()


def _train_two_dimensional(rank: int, instrumented: bool) -> tuple:
    """TP = 2 inside each of 2 FSDP2 data-parallel replicas (a (dp, tp) = (2, 2) mesh); each replica
    its own batches, instrumented after wrapping."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tensor_parallel_gpt(mesh["tp"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    step_module = fxflops.instrument(model, backward=True, strict=True) if instrumented else model
    replica = mesh["dp"].get_local_rank()
    losses = _train_steps(step_module, model.parameters(), replica)
    counted = None
    if instrumented:
        local = step_module.flops.total()  # before the report, which starts the next interval
        report = step_module.flops.report(elapsed_s=1.0, peak_flops=1e12)
        counted = (replica, local, report.hardware_flops, report.world_size)
    return losses, counted


@pytest.mark.long  # 4 ranks on the machine's 2 cores
def test_tensor_parallel_inside_fsdp2_replicas_sums_to_the_replicas_work():
    world = 4
    runs = spawn(_two_dimensional_rank, world, timeout=400)
    replicas = _unsharded_reference(2)  # FlopCounterMode on the unsharded model, each replica's batches
    for rank in range(world):
        plain, (losses, (replica, local, global_, world_size)) = runs[rank]
        assert losses == plain[0], rank
        assert local == replicas[replica] // 2, rank  # its half of every matrix product of its replica
        assert global_ == sum(replicas) and world_size == world


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


LAYERS, MICROBATCHES = 8, 4


def _pipeline_rank(rank: int, world: int, port: int, results, schedule: str) -> None:
    _init(rank, world, port)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    layers = [Layer() for _ in range(LAYERS)]
    chunks = [rank, rank + world] if schedule == "interleaved" else [rank]
    stages_total = world * len(chunks)
    per_chunk = LAYERS // stages_total
    meter = fxflops.Meter()
    stages = [
        PipelineStage(
            fxflops.instrument(nn.Sequential(*layers[c * per_chunk : (c + 1) * per_chunk]), backward=True, strict=True, meter=meter),
            c, stages_total, torch.device("cpu"),
        )
        for c in chunks
    ]
    loss = lambda out, target: out.sum()  # noqa: E731
    runner = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss) if schedule == "interleaved" else Schedule1F1B(stages[0], MICROBATCHES, loss_fn=loss)
    x, target = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 5, 16)
    for _ in range(2):
        if rank == 0:
            runner.step(x, target=target)
        else:
            runner.step(target=target)
        meter.step()
    results[rank] = meter.report(elapsed_s=1.0, peak_flops=1e12).hardware_flops
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.long), "interleaved"])
def test_pipeline_schedules_count_every_layer_once_per_microbatch(schedule):
    world = 2
    results = spawn(_pipeline_rank, world, schedule)
    torch.manual_seed(0)
    whole = nn.Sequential(*[Layer() for _ in range(LAYERS)])
    x = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(1))
    expected = 2 * sum(flop_counter_call(whole, (mb,), {}, backward=True) for mb in x.chunk(MICROBATCHES))
    assert results[0] == results[1] == expected


def _report_on_one_rank(rank: int, world: int, port: int, results) -> None:
    """One training step per rank; rank 0 alone reports its own numbers (``all_ranks=False``: no
    collective, so it returns while rank 1 waits at the barrier), then every rank reports the group's."""
    _init(rank, world, port)
    torch.manual_seed(0)
    wrapper = fxflops.instrument(TinyGPT(CFG), backward=True, strict=True)
    wrapper(_batch(rank, 0)).float().mean().backward()
    wrapper.flops.step()
    alone = None
    if rank == 0:
        report = wrapper.flops.report(elapsed_s=1.0, peak_flops=1e12, all_ranks=False, reset=False)
        alone = (report.hardware_flops, report.world_size, report.rank, str(report).splitlines()[0])
    dist.barrier()
    results[rank] = (alone, wrapper.flops.report(elapsed_s=1.0, peak_flops=1e12).hardware_flops)
    dist.destroy_process_group()


def test_a_report_on_one_rank_alone_is_that_ranks_own_and_waits_for_no_other():
    world = 2
    results = spawn(_report_on_one_rank, world, timeout=120.0)
    expected = [flop_counter_call(TinyGPT(CFG), (_batch(rank, 0),), {}, backward=True) for rank in range(world)]
    flops, world_size, rank, first_line = results[0][0]
    assert (flops, world_size, rank) == (expected[0], 1, 0)
    assert "on rank 0 alone (all_ranks=False)" in first_line
    assert results[0][1] == results[1][1] == sum(expected)  # the collective report still sums the group
