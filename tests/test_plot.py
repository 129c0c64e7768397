"""fxflops.plot: PNGs of the breakdown and scaling plots, and the exact crossover of the scaling split."""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import pytest
import sympy
import torch

import fxflops
from fxflops.errors import UnboundSymbolError
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT
from fxflops.models.tiny_vlm import (
    TinyVLM,
    VLMConfig,
    forward_flops_formula,
    random_batch,
)

import matplotlib  # noqa: F401  (from the test extra; the plots need it)
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import imread

from fxflops.plot import (
    breakdown_levels,
    plot,
    plot_breakdown,
    plot_scaling,
    scaling_split,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    cfg = GPTConfig()
    program = fxflops.trace(TinyGPT(cfg), (torch.randint(0, cfg.vocab, (2, 64)),), dims={"input_ids": {0: "batch", 1: "seq"}})
    return cfg, program


@pytest.fixture(scope="module")
def vlm():
    torch.manual_seed(0)
    cfg = VLMConfig()
    batch = random_batch(cfg, random.Random(0))
    program = fxflops.trace(
        TinyVLM(cfg),
        batch.inputs(),
        dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}},
        segments={"cu_seqlens": "text", "image_grid_thw": "frames"},
    )
    every = dict(zip((str(s) for s in program.all_symbols), program.binder.values(batch.inputs(), {})))
    values = {str(s): every[str(s)] for s in program.symbols}  # tokens, patches, text_p2, frames_p2
    return cfg, program, values


def assert_png(path, fig: Figure, size: tuple[int, int] | None = None) -> None:
    """A real, non-blank PNG of the figure's pixel size (figsize * dpi; ``size`` = (width, height)
    when the test knows it by hand)."""
    assert path.exists()
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    expected = tuple(round(v) for v in fig.get_size_inches() * fig.dpi)
    assert (width, height) == expected
    if size is not None:
        assert (width, height) == size
    image = imread(path)
    assert image.shape[:2] == (height, width)
    pixels = image[..., :3].reshape(-1, 3)
    assert pixels.std() > 0.05
    assert len(np.unique(pixels, axis=0)) > 10


# ---- TinyGPT ----------------------------------------------------------------------------------------
def test_gpt_pngs(gpt, tmp_path):
    _, program = gpt
    values = {"batch": 8, "seq": 4096}
    breakdown = plot_breakdown(program, values, depth=3, path=tmp_path / "breakdown.png")
    assert_png(tmp_path / "breakdown.png", breakdown)
    scaling = plot_scaling(program, "seq", values, path=tmp_path / "scaling.png", figsize=(8, 4), dpi=80)
    assert_png(tmp_path / "scaling.png", scaling, size=(640, 320))
    linear = plot_scaling(program, "seq", values, log=False, points=50, lo=1, hi=2000, path=tmp_path / "linear.png")
    assert_png(tmp_path / "linear.png", linear, size=(1000, 600))  # the default figsize (10, 6) at dpi 100


def test_gpt_crossover_is_the_exact_root(gpt):
    cfg, program = gpt
    # By hand from the config (FlopCounterMode: a multiply-add is 2 FLOPs, causal attention not halved).
    # Attention core QKᵀ and P·V: 2·2·b·s²·(heads·head_dim) per layer.
    attention = 4 * cfg.layers * cfg.heads * cfg.head_dim
    # Linear in s: q/o (h·h each), k/v (h·kv·d each), SwiGLU (3·h·ffn) per layer, and the LM head.
    per_token = 2 * (
        cfg.layers * (2 * cfg.hidden**2 + 2 * cfg.hidden * cfg.kv_heads * cfg.head_dim + 3 * cfg.hidden * cfg.ffn)
        + cfg.hidden * cfg.vocab
    )
    assert (attention, per_token) == (768, 585216)
    b, s = sympy.symbols("batch seq", integer=True, positive=True)
    assert sympy.expand(program.formula() - (attention * b * s**2 + per_token * b * s)) == 0
    # 768·b·s² = 585216·b·s  <=>  s = 585216 / 768, whatever b.
    root = Fraction(per_token, attention)
    assert root == 762

    for batch in (1, 8):
        fig = plot_scaling(program, "seq", {"batch": batch, "seq": 64}, points=20)
        assert isinstance(fig.fxflops_crossover, sympy.Integer)
        assert fig.fxflops_crossover == root
        split = fig.fxflops_scaling
        assert split.crossover_int == 762
        assert sympy.expand(split.superlinear - attention * batch * s**2) == 0
        assert sympy.expand(split.rest - per_token * batch * s) == 0
        a, r = split.at(762)
        assert a == r
        a, r = split.at(761)
        assert a < r


def test_gpt_batch_has_no_superlinear_part(gpt):
    _, program = gpt
    split = scaling_split(program, "batch", {"batch": 8, "seq": 512})
    assert split.superlinear == 0 and split.crossover is None and split.crossover_int is None
    assert "no term grows faster than linearly" in split.note


def test_unknown_symbol_lists_the_symbols(gpt, vlm):
    _, program = gpt
    with pytest.raises(ValueError, match=r"unknown size symbol 'tokens'.*\['batch', 'seq'\]"):
        plot_scaling(program, "tokens", {"batch": 8, "seq": 64})
    _, vprogram, values = vlm
    with pytest.raises(ValueError, match=r"'text_p2' is a segment power sum.*\['patches', 'tokens'\]"):
        scaling_split(vprogram, "text_p2", values)
    with pytest.raises(ValueError, match="unknown symbol"):
        scaling_split(program, "seq", {"batch": 8, "seq": 64, "nope": 1})
    with pytest.raises(UnboundSymbolError, match="batch"):
        scaling_split(program, "seq", {"seq": 64})
    with pytest.raises(ValueError, match="segments must be"):
        scaling_split(vprogram, "tokens", values, segments="uniform")


def test_plot_dispatch(gpt, tmp_path):
    _, program = gpt
    fig = plot(program, "scaling", "seq", {"batch": 2, "seq": 128}, points=10, path=tmp_path / "s.png")
    assert fig.fxflops_crossover == 762
    assert_png(tmp_path / "s.png", fig)
    fig = plot(program, "breakdown", {"batch": 2, "seq": 128}, depth=1)
    assert [[seg.path for seg in level] for level in fig.fxflops_breakdown] == [["layers", "lm_head"]]
    with pytest.raises(ValueError, match="kind must be one of"):
        plot(program, "pie", {"batch": 2, "seq": 128})


def test_draws_into_given_axes(gpt, tmp_path):
    _, program = gpt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=(12, 5), dpi=50)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    assert plot_breakdown(program, {"batch": 1, "seq": 256}, ax=left) is fig
    assert plot_scaling(program, "seq", {"batch": 1, "seq": 256}, ax=right, points=20, path=tmp_path / "both.png") is fig
    assert all(isinstance(a, Axes) for a in fig.axes)
    assert_png(tmp_path / "both.png", fig, size=(600, 250))


# ---- TinyVLM -----------------------------------------------------------------------------------------
def test_vlm_pngs(vlm, tmp_path):
    _, program, values = vlm
    fig = plot_breakdown(program, values, depth=2, path=tmp_path / "breakdown.png")
    assert_png(tmp_path / "breakdown.png", fig)
    assert fig.fxflops_breakdown == breakdown_levels(program, values, depth=2)
    for level in fig.fxflops_breakdown:  # every bar sums to the total
        assert sum(seg.flops for seg in level) == program.total(**values)
    assert {seg.path for seg in fig.fxflops_breakdown[1]} >= {"visual.blocks", "visual.merger", "language_model.layers", "lm_head"}
    for symbol in ("tokens", "patches"):
        fig = plot_scaling(program, symbol, values, points=60, path=tmp_path / f"{symbol}.png")
        assert_png(tmp_path / f"{symbol}.png", fig)
        assert fig.fxflops_crossover is not None


def test_vlm_tokens_crossover_equal_segments(vlm):
    cfg, program, values = vlm
    tokens, patches, text_p2, frames_p2 = (values[k] for k in ("tokens", "patches", "text_p2", "frames_p2"))
    split = scaling_split(program, "tokens", values)
    # "equal": the number of text segments stays n = p1²/p2 (p1 = tokens: no padding in this batch),
    # and p2 = x²/n as x grows.
    n = sympy.Rational(tokens**2, text_p2)
    assert split.segments == {"text": n}
    x = sympy.Symbol("x", positive=True)
    attention = forward_flops_formula(cfg, 0, 0, x**2 / n, 0)  # the text attention core only
    rest = forward_flops_formula(cfg, x, patches, 0, frames_p2)  # everything else, vision held
    roots = [r for r in sympy.solve(sympy.Eq(attention, rest), x) if r.is_positive]
    assert len(roots) == 1
    assert sympy.simplify(split.crossover - roots[0]) == 0
    assert split.crossover_int == math.ceil(float(roots[0]))
    # "one": a single sequence spanning all tokens, p2 = x² (the pack-length² view): an earlier crossover.
    one = scaling_split(program, "tokens", values, segments="one")
    root_one = next(r for r in sympy.solve(sympy.Eq(forward_flops_formula(cfg, 0, 0, x**2, 0), rest), x) if r.is_positive)
    assert sympy.simplify(one.crossover - root_one) == 0
    assert one.crossover < split.crossover
    # an explicit number of equal segments
    four = scaling_split(program, "tokens", values, segments=4)
    assert four.laws == {"text_p2": split.symbol**2 / 4}


def test_vlm_patches_crossover_on_the_integers(vlm):
    """patches // 4 (the 2×2 merger) makes the curves step functions: the crossover is the first
    integer from which the super-linear part is never below the rest, checked by brute force."""
    cfg, program, values = vlm
    tokens, patches, text_p2, frames_p2 = (values[k] for k in ("tokens", "patches", "text_p2", "frames_p2"))
    split = scaling_split(program, "patches", values)
    n = Fraction(patches**2, frames_p2)  # frames held at their number, growing equally

    def gap(m: int) -> Fraction:  # vision attention minus everything else, exactly
        return forward_flops_formula(cfg, 0, 0, 0, Fraction(m * m) / n) - forward_flops_formula(cfg, tokens, m, text_p2, 0)

    c = split.crossover_int
    assert split.crossover == c
    assert gap(c - 1) < 0
    assert all(gap(m) >= 0 for m in range(c, 3 * c))
    assert "floor" in split.note


def test_vlm_equal_needs_the_power_sum(vlm):
    _, program, values = vlm
    without = {k: v for k, v in values.items() if k != "text_p2"}
    with pytest.raises(ValueError, match="text_p2"):
        scaling_split(program, "tokens", without)
    assert scaling_split(program, "tokens", without, segments="one").crossover is not None
