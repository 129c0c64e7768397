"""Meter arithmetic: microbatches, steps, reports, exactness past int64, distributed sums (gloo)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fxflops
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT

CFG = GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=4)


def test_gradient_accumulation_steps_and_report():
    """Two microbatches per step, two steps: the report covers all four, per step is half."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    wrapper = fxflops.instrument(model, dims={"input_ids": {0: "b", 1: "s"}}, backward=True)
    shapes = [(2, 7), (2, 11), (3, 5), (1, 30)]
    for i, (b, s) in enumerate(shapes):
        wrapper(torch.randint(0, 100, (b, s))).sum().backward()
        if i % 2 == 1:
            wrapper.flops.step()
    expected = sum(wrapper.program.total(b=b, s=s) for b, s in shapes)
    recomputed = sum(wrapper.program.total(phase="recompute", b=b, s=s) for b, s in shapes)  # SDPA's Q·Kᵀ
    expected -= recomputed
    report = wrapper.flops.report(elapsed_s=2.0, peak_flops=1e9, tokens="s")
    assert report.steps == 2 and report.calls == 4
    assert recomputed > 0 and report.hardware_flops == report.model_flops + recomputed
    assert report.model_flops == expected
    assert report.tflops_per_gpu == pytest.approx(expected / 2.0 / 1e12)
    assert report.mfu == pytest.approx(expected / 2.0 / 1e9)
    assert report.tokens == sum(s for _, s in shapes)  # the sum of the "s" symbol over the calls
    metrics = report.metrics()
    assert metrics["fxflops/model_flops_per_step"] == expected / 2
    shares = [v for k, v in metrics.items() if k.startswith("fxflops/share/")]
    assert sum(shares) == pytest.approx(1.0)  # depth-1 modules partition the model
    assert wrapper.flops.total() == 0 and wrapper.flops.steps == 0  # the report starts over


def test_a_symbol_no_program_has_gives_unknown_tokens_and_says_which_exist():
    """``report(tokens="tokens")`` where the programs' symbols are ``b`` and ``s`` (or the
    zero-configuration ``input_ids_0``): tokens per second are unknown and said, never 0."""
    wrapper = fxflops.instrument(TinyGPT(CFG), dims={"input_ids": {0: "b", 1: "s"}})
    assert wrapper.flops.report(elapsed_s=1.0, tokens="s").tokens == 0  # nothing counted yet: 0, no warning
    wrapper(torch.randint(0, 100, (2, 7)))
    with pytest.warns(UserWarning, match=r"tokens='tokens'.*symbols: b, s"):
        report = wrapper.flops.report(elapsed_s=1.0, tokens="tokens", images="s")
    assert report.tokens is None and report.images == 7
    assert not report.metrics().get("fxflops/tokens_per_s")


def test_unknown_device_gives_no_mfu_and_says_why():
    meter = fxflops.Meter()
    report = meter.report(elapsed_s=1.0, device="cpu")
    assert report.mfu is None and report.hfu is None
    assert "peak_flops" in report.peak_source
    assert "no MFU" in str(report)


def test_totals_stay_exact_far_past_int64():
    """A step of ~10^21 FLOPs: Python-int accumulation, no overflow or rounding."""
    program = fxflops.trace(TinyGPT(CFG), (torch.randint(0, 100, (2, 8)),), dims={"input_ids": {0: "b", 1: "s"}})
    b, s = 10**8, 10**5
    meter = fxflops.Meter()
    for _ in range(3):
        meter.add(program, program.monomials(*program.values_of(b=b, s=s)))
    exact = 3 * program.total(b=b, s=s)
    assert exact > 10**21 and meter.total() == exact
    assert exact > 2**63


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _data_parallel_rank(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    wrapper = fxflops.instrument(model, dims={"input_ids": {0: "b", 1: "s"}}, backward=True)
    local = 0
    for step in range(2):  # every rank sees different batch shapes
        b, s = 1 + rank, 5 + 7 * rank + step
        wrapper(torch.randint(0, 100, (b, s))).sum().backward()
        local += wrapper.program.total(phase="fwd", b=b, s=s) + wrapper.program.total(phase="bwd", b=b, s=s)
        wrapper.flops.step()
    report = wrapper.flops.report(elapsed_s=1.0, peak_flops=1e12)
    results[rank] = (local, report.model_flops, report.world_size, report.steps)
    dist.destroy_process_group()


def test_data_parallel_ranks_sum_exactly():
    world = 3
    results = mp.Manager().dict()
    mp.spawn(_data_parallel_rank, args=(world, _free_port(), results), nprocs=world, join=True)
    locals_ = [results[r][0] for r in range(world)]
    for rank in range(world):
        _, reduced, world_size, steps = results[rank]
        assert reduced == sum(locals_) and world_size == world and steps == 2


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _pipeline_rank(rank: int, world: int, port: int, results) -> None:
    """2 pipeline stages x 2 virtual chunks: rank r holds chunks r and r + 2 of an 8-layer model (two
    layers each). Microbatches run through the chunks in an interleaved order; every chunk wrapper
    adds to the rank's one Meter."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = [Layer() for _ in range(8)]
    chunks = {c: nn.Sequential(*layers[2 * c : 2 * c + 2]) for c in range(4)}
    meter = fxflops.Meter()
    mine = {c: fxflops.instrument(chunks[c], dims={"input": {0: "rows"}}, backward=True, meter=meter) for c in (rank, rank + 2)}
    microbatches = [torch.randn(r, 16) for r in (3, 5, 4, 6)]
    # interleaved order on this rank: chunk r for mb 0, 1, then chunk r+2 for mb 0, then chunk r for mb 2 ...
    order = [(rank, 0), (rank, 1), (rank + 2, 0), (rank, 2), (rank + 2, 1), (rank, 3), (rank + 2, 2), (rank + 2, 3)]
    for chunk, mb in order:
        x = microbatches[mb].requires_grad_(True)
        mine[chunk](x).sum().backward()
    meter.step()
    report = meter.report(elapsed_s=1.0, peak_flops=1e12)
    results[rank] = report.model_flops
    dist.destroy_process_group()


def test_interleaved_virtual_pipeline_counts_every_layer_once():
    world = 2
    results = mp.Manager().dict()
    mp.spawn(_pipeline_rank, args=(world, _free_port(), results), nprocs=world, join=True)
    # reference: the whole 8-layer model on each microbatch, forward + backward, by hand from the math:
    # per layer and row 2·(16·48 + 48·16) forward; backward 2x (input and weight gradients; inputs
    # require grad so every layer needs its input gradient)
    per_row = 8 * 3 * 2 * (16 * 48 + 48 * 16)
    whole_model = per_row * (3 + 5 + 4 + 6)
    assert results[0] == results[1] == whole_model


def test_a_meter_copied_mid_run_holds_every_call():
    """``pickle`` and ``copy.deepcopy`` of a meter (or of its wrapper) between reads keep the calls
    not yet folded into its sums (was: up to 255 calls per program lost: 512 vs 2560 FLOPs after 5
    calls, ``calls`` still 5)."""
    import copy
    import pickle

    wrapper = fxflops.instrument(nn.Linear(8, 8))
    with torch.no_grad():
        for _ in range(5):
            wrapper(torch.randn(4, 8))
    expected = 5 * 2 * 4 * 8 * 8
    for copied in (pickle.loads(pickle.dumps(wrapper.flops)), copy.deepcopy(wrapper.flops), copy.deepcopy(wrapper).flops):
        assert copied.calls == 5 and copied.total() == expected
    assert wrapper.flops.total() == expected


def test_reports_taken_in_another_thread_while_calls_run_hold_each_call_once():
    """``report()`` in a logging thread while the training thread counts: every call lands in
    exactly one report, FLOPs and calls agreeing, and no report raises (was: 31 % of the calls lost
    between a report's reading and its reset; "dictionary changed size during iteration")."""
    import threading

    wrapper = fxflops.instrument(nn.Linear(8, 8))
    x, calls, reports, errors = torch.randn(4, 8), 600, [], []
    with torch.no_grad():
        wrapper(x)
    wrapper.flops.reset()
    done = threading.Event()

    def log() -> None:
        while not done.is_set():
            try:
                reports.append(wrapper.flops.report(elapsed_s=1.0, all_ranks=False))
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                errors.append(exc)

    logger = threading.Thread(target=log)
    logger.start()
    with torch.no_grad():
        for _ in range(calls):
            wrapper(x)
    done.set()
    logger.join(60)
    reports.append(wrapper.flops.report(elapsed_s=1.0, all_ranks=False))
    assert not errors
    assert sum(r.calls for r in reports) == calls
    assert sum(sum(r.flops.values()) for r in reports) == calls * 2 * 4 * 8 * 8


def test_metadata_on_the_meta_device_is_not_counted_and_leaves_the_meter_readable():
    """Segment offsets on the ``meta`` device (no values: the plain model may still run) make that
    call uncounted, said; the meter's other calls stay readable (was: every later ``total()`` and
    ``report()`` raised "Cannot copy out of meta tensor")."""
    import random
    import warnings

    from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch

    torch.manual_seed(0)
    model = TinyVLM()
    ids, offsets, pixels, grid = random_batch(VLMConfig(), random.Random(0)).inputs()
    wrapper = fxflops.instrument(
        model, dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}},
        segments={"cu_seqlens": "text", "image_grid_thw": "frames"},
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapper(ids, offsets, pixels, grid)
        one = wrapper.flops.total()
        wrapper(ids, offsets.to("meta"), pixels, grid)
        wrapper(ids, offsets, pixels, grid)
    assert wrapper.flops.uncounted == 1 and wrapper.flops.total() == 2 * one
    assert wrapper.flops.report(all_ranks=False).calls == 2


def test_a_misspelt_phase_convention_or_module_is_an_error_not_zero():
    """A phase, convention or module path no program has raises ValueError naming the valid ones
    (was: 0 FLOPs, read as a fact; a convention name raised AttributeError inside ``report``)."""
    wrapper = fxflops.instrument(nn.Linear(8, 8))
    with torch.no_grad():
        wrapper(torch.randn(4, 8))
    flops = 2 * 4 * 8 * 8
    assert wrapper.flops.total(phase="fwd") == wrapper.flops.total(convention="megatron") == flops
    assert wrapper.flops.report(convention="megatron", all_ranks=False, reset=False).flops["fwd"] == flops
    for call in (
        lambda: wrapper.flops.total(phase="backward"), lambda: wrapper.flops.breakdown(phase="Fwd"),
        lambda: wrapper.program.total(phase="bwdd", input_0=4), lambda: wrapper.flops.total(convention="megatronn"),
        lambda: wrapper.program.formula("nope"), lambda: fxflops.verify(wrapper.program, lambda input_0: 0, module="nope"),
    ):
        with pytest.raises(ValueError):
            call()
