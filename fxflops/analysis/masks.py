"""What an attention node says about its mask: causal flags, and masks fxflops cannot read."""

from __future__ import annotations

from typing import Any

import torch

_MASK_ARGUMENTS = ("attn_mask", "attn_bias")
_CAUSAL_ARGUMENTS = ("is_causal", "causal")


def given_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (positional and keyword)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return dict(node.kwargs)
    return dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)


def is_causal(node: torch.fx.Node) -> bool:
    """True if an attention call says it is causal (``is_causal=True`` / varlen ``causal=True``)."""
    given = given_arguments(node)
    return any(given.get(name) is True for name in _CAUSAL_ARGUMENTS)


def mask_notes(node: torch.fx.Node, path: str) -> list[str]:
    """Attention given a mask fxflops cannot read (a dense mask tensor, a flex block mask) is counted
    as dense work, under every convention; say so."""
    if "flex_attention" in str(node.target):
        return [
            f"{path or '<root>'}: {node.target}'s score_mod and block mask are not read; counted dense under "
            "every convention (a causal block mask is not halved)"
        ]
    given = given_arguments(node)
    return [
        f"{path or '<root>'}: {node.target} has a mask ({name}); counted as the dense work the kernel does, "
        "masked entries included (a block-diagonal mask over packed sequences costs (Σsᵢ)² here, not Σsᵢ²)"
        for name in _MASK_ARGUMENTS
        if isinstance(given.get(name), torch.fx.Node)
    ]
