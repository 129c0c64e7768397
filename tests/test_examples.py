"""The runnable examples stay runnable (short runs)."""

from __future__ import annotations

import importlib.util
import pathlib

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_example_logs_flops_and_mfu(capsys):
    train = _load("train")
    assert train.main(["--steps", "4", "--log-every", "2", "--peak-tflops", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("TFLOP/s per GPU") == 2 and "MFU" in out and "visual.merger" in out
    assert "(1 capture)" in out
