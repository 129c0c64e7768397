"""The adapter pieces that stand in for a family's value-dependent code while capturing (anyres tiles
``adapters/tiles.py``, patch grids ``adapters/patch_grids.py``, real frames ``adapters/frames.py``)
count exactly under every convention, not only the matmul family FlopCounterMode counts: with
``count="all"`` (elementwise ops, norms, softmax, reductions at ``rules/elementwise.py``'s costs)
a symbolic program's call equals the same call measured op by op on the model's own code (the same
wrapper with the piece switched off: the module whose code reads values is measured, its children
symbolic), forward per module, and in training the forward phase (the total under the matmul
convention). The zero test and sums by which Idefics3 selects its real frames were once left out of
the trace: a silent undercount under ``"all"``, which this test found.

Not asserted: the backward phase under ``"all"``. A traced backward's elementwise ops are autograd's
graph as traced (``docs/conventions.md``), which differs from eager's engine by its bookkeeping
(gradient accumulation adds), and a stand-in's per-image packing leaves out its backward's
reductions (the newline column's expand): see the session notes.
"""

from __future__ import annotations

import random

import pytest
import torch

import fxflops
from fxflops.conventions import FLOPCOUNTER
from test_hf_anyres import FAMILIES as ANYRES
from test_hf_measured_families import build_idefics2, build_idefics3, build_smolvlm, idefics2_batch, idefics3_batch
from test_hf_patch_grids import FAMILIES as GRIDS
from test_hf_patch_grids import batch_of

pytest.importorskip("transformers")

EVERY_OP = FLOPCOUNTER.but(count="all")
CALLS = 4


def _grid_family(family: str):
    return GRIDS[family], lambda model, rng, images: batch_of(family, rng, rng.randint(1, 6))


FAMILIES = {  # family -> (build, batch(model, rng, images), the adapter piece)
    **{f: (*pair, "tiles") for f, pair in ANYRES.items()},
    **{f: (*_grid_family(f), "grids") for f in GRIDS},
    "idefics3": (build_idefics3, idefics3_batch, "frames"),
    "smolvlm": (build_smolvlm, idefics3_batch, "frames"),
    "idefics2": (build_idefics2, idefics2_batch, "frames"),
}
DEFAULT = ("idefics3",)  # the family whose stand-in once missed counted work; the rest in the long suite
PARAMETERS = [f if f in DEFAULT else pytest.param(f, marks=pytest.mark.long) for f in FAMILIES]


def wrappers(family: str, **options):
    build, make_batch, piece = FAMILIES[family]
    model = build()
    symbolic = fxflops.instrument(model, strict=True, **options)
    measured = fxflops.instrument(model, strict=True, **options)
    setattr(measured._adapter, piece, None)  # the family's own value-reading code, measured
    return model, make_batch, symbolic, measured


@pytest.mark.parametrize("family", PARAMETERS)
def test_forward_counts_every_op_as_measured(family):
    model, make_batch, symbolic, measured = wrappers(family)
    rng = random.Random(f"{family}-every-op")
    for i in range(CALLS):
        batch = make_batch(model, rng, images=True)
        del batch["labels"]
        for wrapper in (symbolic, measured):
            wrapper.flops.reset()
            with torch.no_grad():
                wrapper(**batch)
        assert symbolic.measured == {} and measured.measured, (family, i)
        got, expected = symbolic.flops.breakdown(convention=EVERY_OP), measured.flops.breakdown(convention=EVERY_OP)
        assert got[""] == expected[""] > symbolic.flops.total() > 0, (family, i)
        assert got == expected, (family, i, {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v})


@pytest.mark.long  # ~25 s a family
@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_counts_every_op_as_measured(family):
    model, make_batch, symbolic, measured = wrappers(family, backward=True)
    rng = random.Random(f"{family}-every-op-training")
    for i in range(CALLS - 1):
        batch = make_batch(model, rng, images=True)
        for wrapper in (symbolic, measured):
            wrapper.train()
            wrapper.flops.reset()
            model.zero_grad(set_to_none=True)
            wrapper(**batch).loss.backward()
        assert symbolic.measured == {} and measured.measured, (family, i)
        got, expected = symbolic.flops.total(convention=EVERY_OP, phase="fwd"), measured.flops.total(convention=EVERY_OP, phase="fwd")
        assert got == expected > symbolic.flops.total(phase="fwd") > 0, (family, i, got, expected)
        assert symbolic.flops.total() == measured.flops.total() > got, (family, i)
