"""Sizes derived from input values (``capture/derived.py``) on an accelerator: binding a call and
checking its program's guards read nothing on the host (``fxflops/guards.py``).

No accelerator here: the binder's device path is taken on CPU tensors (``binder.host_metadata =
False``: every derived size, power sum and mask statistic a 0-d tensor, as for inputs on a GPU),
and every way a tensor's value reaches the host (``bool``, ``int``, ``item``, ``tolist``, ...)
raises while the call is bound, checked against the guards and turned into its monomials. The
guards on derived sizes are then the device flag multiplied into the monomials: exact for a call
inside them, and a call outside them (SmolVLM's frames all padding) is reported uncounted, never
counted wrong. Families: Idefics3 (real frames), Mistral 3 (patch grids), Phi-4-multimodal (image
tokens).
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

import fxflops
from reference import flop_counter_modules
from test_hf_measured_families import FRAME_TOKENS, IMAGE, build_idefics3, build_phi4_multimodal, build_smolvlm, idefics3_batch, phi4_batch
from test_hf_patch_grids import FAMILIES as GRIDS
from test_hf_patch_grids import batch_of

pytest.importorskip("transformers")

READS = ("__bool__", "__int__", "__index__", "__float__", "item", "tolist", "numpy")
FAMILIES = {
    "idefics3": (build_idefics3, idefics3_batch),
    "mistral3": (GRIDS["mistral3"], lambda model, rng, images: batch_of("mistral3", rng, rng.randint(2, 6))),
    "phi4_multimodal": (build_phi4_multimodal, phi4_batch),
}


@contextlib.contextmanager
def no_host_reads():
    """Reading any tensor's value on the host raises (what a sync would be on an accelerator)."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def read(*_args, **_kwargs):
        raise AssertionError("a tensor value was read on the host")

    try:
        for name in saved:
            setattr(torch.Tensor, name, read)
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def device_count(wrapper, program, batch: dict) -> tuple:
    """The call's monomials through the device path, with no host read."""
    args, kwargs = wrapper._adapter.prepare((), batch)
    with no_host_reads():
        values = program.binder.values(args, kwargs)
        assert program.within_guards(*values)
        return program.monomials(*values)


@pytest.mark.parametrize("family", FAMILIES)
def test_binding_and_guards_read_nothing_on_the_host(family):
    build, make_batch = FAMILIES[family]
    model = build()
    wrapper = fxflops.instrument(model, strict=True)
    rng = random.Random(f"{family}-device")
    batches = [make_batch(model, rng, True) for _ in range(4)]
    for batch in batches:
        batch.pop("labels")
    with torch.no_grad():
        wrapper(**batches[0])
    program = next(p for p in wrapper.programs if p.derived)
    assert any(set(map(str, g.expr.free_symbols)) & set(program.derived) for g in program.guards)  # guards on them
    program.binder.host_metadata = False
    for i, batch in enumerate(batches):
        monomials = device_count(wrapper, program, batch)
        assert program.malformed(monomials) == {}, (family, i)
        assert program.evaluate(monomials) == flop_counter_modules(model, batch, backward=False)[""], (family, i)


def test_frames_all_padding_on_a_device_are_reported_uncounted():
    """Outside the guard image_frames >= 1 (every frame padding: SmolVLM runs its first frame anyway),
    known only on the device: the call adds no FLOPs, and the report counts it uncounted and says why
    (with the frames on the host it is measured exactly: test_hf_frames.py)."""
    model = build_smolvlm()
    wrapper = fxflops.instrument(model, strict=True)
    batch = idefics3_batch(model, random.Random(4), True)
    del batch["labels"]
    with torch.no_grad():
        wrapper(**batch)
    program = next(p for p in wrapper.programs if p.derived)
    program.binder.host_metadata = False
    padding = dict(batch, pixel_values=torch.zeros_like(batch["pixel_values"][:, :1]),
                   pixel_attention_mask=batch["pixel_attention_mask"][:, :1])
    ids = padding["input_ids"].masked_fill(padding["input_ids"] == IMAGE, 0)
    ids[0, :FRAME_TOKENS] = IMAGE  # one frame's tokens: what the model's fallback frame fills
    padding["input_ids"] = ids
    monomials = device_count(wrapper, program, padding)
    assert program.evaluate(monomials) == 0
    assert program.malformed(monomials) == {fxflops.guards.OUTSIDE_KEY: 1}
    wrapper.flops.reset()
    with torch.no_grad():
        wrapper(**padding)
    with pytest.warns(UserWarning, match="outside their program's guards"):
        report = wrapper.flops.report()
    assert report.uncounted == 1 and report.calls == 0 and wrapper.captures == 1
    # an explicit count (which may read the device) refuses it as outside the guard, not as bad
    # metadata, with the host's words
    with pytest.raises(fxflops.errors.GuardError) as on_device:
        program.count(**padding)
    program.binder.host_metadata = True
    with pytest.raises(fxflops.errors.GuardError) as on_host:
        program.count(**padding)
    assert str(on_device.value) == str(on_host.value)
    assert "image_frames=0" in str(on_host.value) and "image_frames >= 1" in str(on_host.value)
