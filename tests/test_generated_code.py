"""Snapshots of the code fxflops generates (issue 16): the binder's reader and the program's
monomials and guards, for a dense LM and the example VLM (two segment families: packed text offsets
and an image grid, each read on the host or, for metadata on an accelerator, with device arithmetic).
A change of a generator shows here as a readable diff of the generated Python.

The expected text lives in ``tests/snapshots/``; after an intended change, regenerate it with
``FXFLOPS_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_generated_code.py`` and review the diff.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import pytest
import torch

import fxflops
from fxflops.models import tiny_vlm
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("FXFLOPS_UPDATE_SNAPSHOTS") == "1"


def _matches_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}: run with FXFLOPS_UPDATE_SNAPSHOTS=1 and review it"
    assert text == path.read_text(), f"the generated code of {name} changed (FXFLOPS_UPDATE_SNAPSHOTS=1 to accept)"


def _dense_lm() -> tuple[fxflops.Program, tuple, dict]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=2))
    args = (torch.randint(0, 100, (2, 9)),)
    return fxflops.trace(model, args, dims={"input_ids": {0: "batch", 1: "seq"}}, backward=True), args, {}


@functools.cache
def _vlm() -> tuple[fxflops.Program, tuple, dict]:
    example = tiny_vlm.example()
    args = tuple(example["args"])
    program = fxflops.trace(example["model"], args, dims=example["dims"], segments=example["segments"])
    return program, args, {}


@pytest.mark.parametrize("case", ["dense_lm", "vlm"])
def test_generated_code_matches_its_snapshot(case):
    program, args, kwargs = {"dense_lm": _dense_lm, "vlm": _vlm}[case]()
    _matches_snapshot(f"{case}_binder", program.binder.source(args, kwargs))
    _matches_snapshot(f"{case}_program", program.source())


def test_the_reader_computes_device_metadata_as_it_reads_host_metadata():
    """The reader above holds both paths (``host_metadata``): metadata on an accelerator is summed
    with tensor arithmetic (no host sync); on CPU tensors both paths give the same values."""
    program, args, kwargs = _vlm()
    program = copy.deepcopy(program)  # the cached one keeps reading on the host
    on_host = program.binder.values(args, kwargs)
    program.binder.host_metadata = False  # the accelerator's path, on CPU tensors
    assert "else:" in program.binder.source(args, kwargs)
    assert [int(v) for v in program.binder.values(args, kwargs)] == list(on_host)
