"""The one registry mapping operators to FLOPs rules.

A *rule* is a small pure function. It receives the operator's arguments exactly as the op's schema
orders them, except that every tensor is replaced by its shape (a tuple whose entries are ``int`` or
``sympy.Expr``), plus the keyword ``out_shape`` holding the shape(s) of the result (a shape, or a
tuple of shapes for ops with several outputs, ``None`` where an output is not a tensor; the name avoids
the ``out`` argument some backward schemas have). It returns the FLOPs as an ``int`` or a
``sympy.Expr``.

Rules only do arithmetic on the shapes, so the same function serves a concrete count (plain ints) and
a symbolic one (sympy expressions in the traced size symbols). Convention: one multiply-add = 2 FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Rule = Callable[..., Any]

_RULES: dict[Any, Rule] = {}


def _key(op: Any) -> Any:
    """Registry key of ``op``: the overload packet for aten/custom overloads, the object otherwise."""
    return getattr(op, "overloadpacket", op)


def register(*ops: Any) -> Callable[[Rule], Rule]:
    """Decorator registering ``rule`` for every op in ``ops``.

    ``ops`` may be ``OpOverloadPacket`` (``torch.ops.aten.mm``), ``OpOverload`` (``...mm.default``:
    the rule then covers every overload of that packet) or any other callable target that appears in
    an FX graph (a higher-order op such as ``flex_attention``). Registering again replaces the rule,
    which is how users override a built-in rule or add one for their own custom op.
    """

    def decorator(rule: Rule) -> Rule:
        for op in ops:
            _RULES[_key(op)] = rule
        return rule

    return decorator


def rule_for(op: Any) -> Rule | None:
    """The rule registered for ``op`` (or its overload packet), or ``None``."""
    return _RULES.get(_key(op))


def registered_ops() -> list[Any]:
    """Every op key that has a rule, in registration order."""
    return list(_RULES)


def shape_of(value: Any) -> Any:
    """Replace tensors in ``value`` (possibly nested in lists/tuples) by their shapes as tuples."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return type(value)(shape_of(v) for v in value)
    return value
