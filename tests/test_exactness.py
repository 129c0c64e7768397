"""Forward FLOPs from ONE trace equal FlopCounterMode's concrete counts, total and per module.

Reference: ``reference.reference_counts`` (FlopCounterMode on the real forward; SDPA on the MATH
backend because FlopCounterMode counts the CPU flash kernel as 0). Every draw is a new random shape;
each model is captured once (``wrapper.captures == 1`` after all draws).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import fxflops
from reference import count_and_compare
from zoo import CASES

DRAWS_PER_MODEL = 45  # 5 models -> 225 random shapes


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_flops_equal_flopcountermode(case):
    torch.manual_seed(0)
    model = case.factory()
    wrapper = fxflops.instrument(model, dims=case.dims, on_miss="raise", strict=True)
    seen = []

    @settings(max_examples=DRAWS_PER_MODEL, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case.shapes)
    def check(shapes):
        inputs = case.make(shapes)
        got, expected = count_and_compare(wrapper, model, inputs, shapes)
        assert wrapper.program.count(*inputs) == got[""] == wrapper.flops.total() == expected[""]
        for path in {p for p, v in got.items() if v} - set(expected):
            # FlopCounterMode only tracks modules whose forward runs; fxflops also rolls up the
            # containers that are never called (ModuleList, ModuleDict) as the sum of their children.
            container = model.get_submodule(path)
            assert isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict)), path
            children = [f"{path}.{name}" for name, _ in container.named_children()]
            assert got[path] == sum(got[c] for c in children), (shapes, path)
        seen.append(shapes)

    check()
    assert len(seen) >= DRAWS_PER_MODEL
    assert wrapper.captures == 1, "one capture must serve every draw"
    assert not wrapper.program.unsupported
