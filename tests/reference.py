"""The independent reference: FlopCounterMode on a real forward, with its CPU-attention bug corrected.

FlopCounterMode counts ``aten._scaled_dot_product_flash_attention_for_cpu`` as 0 FLOPs (wrong: the CPU
kernel does the full QKᵀ and P·V work). The correction: run SDPA on the MATH backend, which computes the
same attention as explicit ``bmm`` calls that FlopCounterMode does count (4·b·h·s_q·s_k·d, GQA at query
heads, causal not halved, exactly the convention fxflops follows). No number comes from fxflops.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


def reference_counts(model: torch.nn.Module, *args, **kwargs) -> dict[str, int]:
    """Per-module forward FLOPs by module path (``""`` = root) from FlopCounterMode, MATH SDPA."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*args, **kwargs)
    root = type(model).__name__
    counts = {}
    for name, per_op in counter.get_flop_counts().items():
        if name == "Global":
            continue
        path = "" if name == root else name[len(root) + 1 :]
        counts[path] = sum(per_op.values())
    counts.setdefault("", counter.get_total_flops())
    return counts


def count_and_compare(
    wrapper, reference_model: torch.nn.Module, inputs: tuple, label: object
) -> tuple[dict[str, int], dict[str, int]]:
    """Count one call with an ``instrument()`` wrapper and assert every module FlopCounterMode
    tracks in ``reference_model`` has the same FLOPs; returns (fxflops' breakdown, the reference)."""
    expected = reference_counts(reference_model, *inputs)
    wrapper.flops.reset()
    with torch.no_grad():
        wrapper(*inputs)
    got = wrapper.flops.breakdown()
    for path, flops in expected.items():
        assert got[path] == flops, (label, path)
    return got, expected
