"""The command line end to end, through subprocesses: report, check, JSON, plot, exit codes (usage errors in-process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    assert "language_model.layers.*.self_attn: counted at tokens**2, traced text_p2" in different.stdout


def test_usage_errors_list_what_is_valid(capsys):
    """In-process (``cli.main``, what ``python -m fxflops`` runs): four interpreters starting torch
    cost 15 s of the default suite; the other tests here go through the subprocess."""
    from fxflops.cli import main

    def run(*args: str) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().err

    code, err = run("report", VLM, "--dim", "seq=4")
    assert code == 2 and "'tokens'" in err and "'patches'" in err
    code, err = run("report", "fxflops.models.tiny_vlm:nothing")
    assert code == 2 and "cannot load factory" in err
    code, err = run("check", VLM, "--formula", "nope")
    assert code == 2 and "'hand'" in err
    code, err = run("report", VLM, "--convention", "nope")
    assert code == 2 and "megatron" in err


@pytest.mark.long  # two subprocesses tracing a transformers model: ~70 s
def test_report_from_a_config_json_equals_the_factory_route(tmp_path):
    """Planning without weights: ``report config.json`` builds the model on the meta device; its
    table equals the one of a factory building the same model with real weights."""
    import os

    import transformers

    transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ).save_pretrained(tmp_path / "tiny")
    (tmp_path / "tiny_factory.py").write_text(
        "import torch, transformers\n"
        "def example():\n"
        f"    config = transformers.AutoConfig.from_pretrained({str(tmp_path / 'tiny')!r})\n"
        "    ids = torch.zeros(1, 16, dtype=torch.long)\n"
        "    return {'model': transformers.AutoModelForCausalLM.from_config(config).eval(), 'args': (), 'kwargs': {'input_ids': ids, 'labels': ids}}\n"
    )
    documents = []
    for spec, name in ((str(tmp_path / "tiny" / "config.json"), "planned.json"), ("tiny_factory:example", "factory.json")):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
        result = subprocess.run(
            [sys.executable, "-m", "fxflops", "report", spec, "--backward", "--dim", "batch=4", "--dim", "seq=2048", "--json", str(tmp_path / name)],
            capture_output=True, text=True, timeout=300, env=env,
        )
        assert result.returncode == 0, result.stderr
        documents.append(json.loads((tmp_path / name).read_text()))
    planned, factory = documents
    assert planned["values"] == factory["values"] == {"batch": 4, "seq": 2048}
    assert planned["modules"] == factory["modules"] and planned["total"] == factory["total"] > 0
    result = fxflops("report", str(tmp_path / "tiny"), "--backward", "--dim", "batch=4", "--dim", "seq=2048", "--depth", "0", "--peak", "1e15", "--mfu", "0.5")
    root = planned["modules"][0]
    seconds = (root["fwd"] + root["bwd"]) / (1e15 * 0.5)  # model FLOPs at 50% of a 1 PFLOP/s peak
    assert result.returncode == 0 and f"{seconds * 1e3:,.3f} ms per call" in result.stdout, result.stdout[-400:]
    result = fxflops("report", str(tmp_path))  # a folder without a config.json
    assert result.returncode == 2 and "no config.json" in result.stderr


@pytest.mark.long  # two subprocesses tracing a transformers VLM with its backward: ~40 s
def test_report_of_a_vlm_config_with_images_equals_the_factory_route(tmp_path):
    """``report config.json --image WxH ...`` lays the images out as Qwen2-VL's processor does; the
    table equals a factory's whose example is laid out by hand (two images, 32x48 and 16x16 pixels:
    patch 4 x merge 2 grids (1, 12, 8) and (1, 4, 4), 24 and 4 image tokens)."""
    import os

    from fxflops.models import hf_zoo

    hf_zoo.build("qwen2_vl", "eager").config.save_pretrained(tmp_path / "tiny_vl")
    start, end, image = hf_zoo.START, hf_zoo.END, hf_zoo.IMAGE
    (tmp_path / "vl_factory.py").write_text(
        "import torch, transformers\n"
        "def example():\n"
        f"    config = transformers.AutoConfig.from_pretrained({str(tmp_path / 'tiny_vl')!r})\n"
        f"    ids = torch.tensor([[1] * 16 + [{start}] + [{image}] * 24 + [{end}] + [{start}] + [{image}] * 4 + [{end}]])\n"
        "    model = transformers.AutoModelForImageTextToText.from_config(config).eval()\n"
        "    kwargs = {'input_ids': ids, 'labels': ids, 'mm_token_type_ids': (ids == " f"{image}" ").long(),\n"
        "              'pixel_values': torch.randn(96 + 16, 3 * 2 * 4 * 4), 'image_grid_thw': torch.tensor([[1, 12, 8], [1, 4, 4]])}\n"
        "    return {'model': model, 'args': (), 'kwargs': kwargs}\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    documents = []
    for spec, images in ((str(tmp_path / "tiny_vl"), ["--image", "32x48", "--image", "16x16"]), ("vl_factory:example", [])):
        path = tmp_path / f"{len(documents)}.json"
        result = subprocess.run(
            [sys.executable, "-m", "fxflops", "report", spec, *images, "--backward", "--json", str(path)],
            capture_output=True, text=True, timeout=300, env=env,
        )
        assert result.returncode == 0, result.stderr
        documents.append(json.loads(path.read_text()))
    planned, factory = documents
    assert planned["values"] == factory["values"] and planned["values"]["patches"] == 112
    assert planned["values"]["image_cu_seqlens_p2"] == 96**2 + 16**2  # the per-image attention's power sum
    assert planned["modules"] == factory["modules"] and planned["total"] == factory["total"] > 0


def test_image_sizes_the_processor_would_not_produce_are_usage_errors(tmp_path, capsys):
    """Exit code 2 and the reason, before anything is traced (in-process: no trace runs)."""
    from fxflops.cli import main
    from fxflops.models import hf_zoo

    hf_zoo.build("llava_clip", "eager").config.save_pretrained(tmp_path / "llava")
    for argv, reason in (
        (["report", str(tmp_path / "llava"), "--image", "30x32"], "resizes every image to 32x32"),
        (["report", str(tmp_path / "llava"), "--image", "32"], "WIDTHxHEIGHT"),
        (["report", GPT, "--image", "32x32"], "config.json"),
    ):
        assert main(argv) == 2, argv
        assert reason in capsys.readouterr().err, argv


def test_processor_free_layouts_follow_the_config():
    """The example calls' shapes for the two layouts, against the processors' arithmetic."""
    import transformers

    from fxflops.integrations.hf_examples import example_call

    qwen = transformers.Qwen2VLConfig()  # patch 14, merge 2: sides rounded to multiples of 28
    call = example_call(qwen, [(448, 448), (300, 200)], text_tokens=5)
    assert call["image_grid_thw"].tolist() == [[1, 32, 32], [1, 14, 22]]  # 200 -> 196, 300 -> 308
    assert call["pixel_values"].shape == (32 * 32 + 14 * 22, 3 * 2 * 14 * 14)
    assert int((call["input_ids"] == qwen.image_token_id).sum()) == (32 * 32 + 14 * 22) // 4
    assert call["input_ids"].shape[1] == 5 + (32 * 32 + 14 * 22) // 4 + 2 * 2
    gemma = transformers.Gemma3Config()  # the tower's image_size (224 by default), 256 tokens per image between boi and eoi
    call = example_call(gemma, [(224, 224)] * 2, text_tokens=3)
    assert call["pixel_values"].shape == (2, 3, 224, 224) and call["input_ids"].shape[1] == 3 + 2 * 258
    assert int(call["token_type_ids"].sum()) == 512
    with pytest.raises(ValueError, match="cannot lay out"):
        example_call(transformers.LlavaNextConfig(), [(336, 336)])
    with pytest.raises(ValueError, match="no vision_config"):
        example_call(transformers.LlamaConfig(), [(32, 32)])
