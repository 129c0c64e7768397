"""Module paths (``"visual.blocks.0.attn"``): the one place their arithmetic is written.

``""`` is the root module; a path's depth is its number of parts; a node's path is the innermost
``nn.Module`` it ran in, from the ``nn_module_stack`` that ``make_fx`` and Dynamo record.
"""

from __future__ import annotations

import torch

_DYNAMO_ROOT = "L['self']"


def module_path(node: torch.fx.Node) -> str:
    """The path of the innermost ``nn.Module`` the node ran in (``""`` = the root). Dynamo names the
    root ``L['self']`` (``L['self'].layers.0.attn``); that prefix is dropped."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]
    if path.startswith(_DYNAMO_ROOT):
        path = path[len(_DYNAMO_ROOT) :].lstrip(".")
    return path


def join(prefix: str, path: str) -> str:
    """``path`` inside the module at ``prefix``: ``join("visual", "blocks.0") == "visual.blocks.0"``."""
    return ".".join(p for p in (prefix, path) if p)


def inside(path: str, prefix: str) -> bool:
    """``path`` is the module at ``prefix`` or one of its descendants (``prefix`` not the root)."""
    return path == prefix or path.startswith(prefix + ".")


def moved(path: str, template: str, copy: str) -> str:
    """``path`` (inside ``template``) at the same place inside ``copy``."""
    return copy + path[len(template) :]


def depth(path: str) -> int:
    """0 for the root, 1 for its children, ..."""
    return 0 if path == "" else path.count(".") + 1


def ancestors(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b", "a.b.c"]``."""
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]
