"""What work an executed op does, from what it is: the kind of an op without a rule, and whether an
op does floating-point work at all (the questions a measured op and a memoized function ask)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from fxflops.rules.elementwise import MOVES_DATA
from fxflops.rules.not_counted import is_not_counted, touches_floats
from fxflops.rules.registry import entry_for


@functools.cache
def work_without_rule(func: Any) -> str:
    """What an op without a rule is, from what it is (its name, its ATen tags), as
    :func:`~fxflops.rules.elementwise.elementwise_cost` prices it: ``"pointwise"`` or
    ``"reduction"``, ``"unsupported"`` (a floating op fxflops has no rule for) or ``"none"`` (data
    movement, views, indexing, index math: no floating-point work)."""
    if not isinstance(func, torch._ops.OpOverload) or func._schema.name.split("::")[-1] in MOVES_DATA:
        return "none"
    if torch.Tag.pointwise in func.tags:
        return "pointwise"
    if torch.Tag.reduction in func.tags:
        return "reduction"
    return "none" if is_not_counted(func) else "unsupported"


def does_floating_work(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether one executed op does work some convention counts: it has a rule (a matmul, a
    convolution, attention), or it is pointwise, a reduction or an unsupported op on floating-point
    tensors (``count="all"`` counts the first two)."""
    if entry_for(func) is not None:
        return True
    return work_without_rule(func) != "none" and touches_floats([*args, *kwargs.values()], out)
