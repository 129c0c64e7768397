"""The command line end to end, through subprocesses: report, check, JSON, plot, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

VLM = "fxflops.models.tiny_vlm:example"
GPT = "fxflops.models.tiny_gpt:example"


def fxflops(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxflops", *args], capture_output=True, text=True, timeout=300)


def test_report_prints_a_table_with_phases_and_formulas():
    result = fxflops("report", GPT, "--backward", "--dim", "seq=512", "--depth", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("module", "fwd", "bwd", "recompute", "share", "formula", "layers", "lm_head", "seq=512", "flopcounter"):
        assert text in out


def test_report_json_follows_its_schema(tmp_path):
    path = tmp_path / "report.json"
    result = fxflops("report", VLM, "--json", str(path), "--dim", "tokens=2048", "--convention", "megatron")
    assert result.returncode == 0, result.stderr
    doc = json.loads(path.read_text())
    assert set(doc) == {"convention", "symbols", "values", "total", "modules", "guards", "unsupported"}
    assert doc["convention"].startswith("megatron") and doc["values"]["tokens"] == 2048
    assert set(doc["symbols"]) >= {"tokens", "patches", "text_p2", "frames_p2"}
    root, *rest = doc["modules"]
    assert root["module"] == "<model>" and {"fwd", "bwd", "recompute", "share", "formula"} <= set(root)
    assert root["fwd"] + root["bwd"] + root["recompute"] == doc["total"]
    assert root["share"] == 1.0 and all(0 < m["share"] <= 1 for m in rest)


def test_report_plot_writes_a_png(tmp_path):
    from matplotlib.image import imread  # matplotlib comes with the test extra

    path = tmp_path / "breakdown.png"
    result = fxflops("report", VLM, "--plot", str(path))
    assert result.returncode == 0, result.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(path)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 300 and pixels.std() > 0.01


def test_check_passes_and_fails_with_exit_codes():
    equal = fxflops("check", GPT, "--formula", "megatron", "--backward", "--convention", "megatron")
    assert equal.returncode == 0 and "EQUAL" in equal.stdout
    different = fxflops("check", VLM, "--formula", "pack-length-squared")
    assert different.returncode == 1
    assert "missing 768*text_p2: language_model.layers.*.self_attn" in different.stdout


def test_usage_errors_list_what_is_valid():
    bad_dim = fxflops("report", VLM, "--dim", "seq=4")
    assert bad_dim.returncode == 2 and "'tokens'" in bad_dim.stderr and "'patches'" in bad_dim.stderr
    bad_factory = fxflops("report", "fxflops.models.tiny_vlm:nothing")
    assert bad_factory.returncode == 2 and "cannot load factory" in bad_factory.stderr
    bad_formula = fxflops("check", VLM, "--formula", "nope")
    assert bad_formula.returncode == 2 and "'hand'" in bad_formula.stderr
    bad_convention = fxflops("report", VLM, "--convention", "nope")
    assert bad_convention.returncode == 2 and "megatron" in bad_convention.stderr
