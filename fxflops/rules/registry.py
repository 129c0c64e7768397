"""The one registry mapping operators to FLOPs rules.

A *rule* is a small pure function. It receives the operator's arguments exactly as the op's schema
orders them, except that every tensor is replaced by its shape (a tuple whose entries are ``int`` or
``sympy.Expr``), plus the keyword ``out_shape`` holding the shape(s) of the result (a shape, or a
tuple of shapes for ops with several outputs, ``None`` where an output is not a tensor; the name avoids
the ``out`` argument some backward schemas have). It returns the FLOPs as an ``int`` or a
``sympy.Expr``.

Arguments that are cumulative segment offsets (``cu_seqlens``) carry their information in their data,
not their shape: a rule registered with ``segments=(...)`` (positions or schema names of such
arguments) receives there a :class:`~fxflops.analysis.segments.SegmentLengths` instead of a shape, whose
``power_sum(k)`` is the symbol pₖ = Σᵢ sᵢᵏ of that segment family.

Rules only do arithmetic on the shapes, so the same function serves a concrete count (plain ints) and
a symbolic one (sympy expressions in the traced size symbols). Convention: one multiply-add = 2 FLOPs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

Rule = Callable[..., Any]

KINDS = ("matmul", "elementwise", "embedding")


@dataclass(frozen=True)
class Entry:
    """A registered rule and what the Program needs to know about it.

    ``kind`` says which conventions count it: ``"matmul"`` (matrix products and attention, always),
    ``"elementwise"`` (pointwise, norms, softmax, reductions: only under ``count="all"``) or
    ``"embedding"`` (gathers: only when a convention counts them). ``causal``, for attention, gives the
    exact FLOPs of a causal call (the lower triangle, s(s+1)/2 pairs per sequence) from the same
    arguments; conventions that halve or keep causal attention use it. ``segments`` as above.
    ``recomputed``, for a fused backward, gives the share of its FLOPs that recomputes forward work
    (flash-style attention backward recomputes S = Q·Kᵀ): the Program bills that share to the
    ``recompute`` phase, so model FLOPs (MFU) leave it out as they leave out checkpointing recompute.
    """

    rule: Rule
    segments: tuple[int | str, ...] = ()
    causal: Rule | None = None
    kind: str = "matmul"
    recomputed: Rule | None = None


_ENTRIES: dict[Any, Entry] = {}
_VERSION = [0]  # bumped by every change of _ENTRIES: caches of prices computed from the rules check it


def registry_version() -> int:
    """A number that changes whenever a rule is registered or removed (a cache of prices computed
    from the registry is stale when it has changed)."""
    return _VERSION[0]


def _key(op: Any) -> Any:
    """Registry key of ``op``: the overload packet for aten/custom overloads, the object otherwise."""
    return getattr(op, "overloadpacket", op)


def _name_key(op: Any) -> str | None:
    """``"namespace::name"`` of an op overload, for rules registered by name before the op exists."""
    schema = getattr(op, "_schema", None)
    return schema.name if schema is not None else None


def register(
    *ops: Any,
    segments: tuple[int | str, ...] = (),
    causal: Rule | None = None,
    kind: str = "matmul",
    recomputed: Rule | None = None,
    replace: bool = False,
) -> Callable[[Rule], Rule]:
    """Decorator registering ``rule`` for every op in ``ops``.

    ``ops`` may be ``OpOverloadPacket`` (``torch.ops.aten.mm``), ``OpOverload`` (``...mm.default``:
    the rule then covers every overload of that packet), a ``"namespace::name"`` string (for an op of
    a package that may not be imported yet, e.g. ``"flash_attn::_flash_attn_varlen_forward"``) or
    any other callable target that appears in an FX graph (a higher-order op such as
    ``flex_attention``). ``segments``, ``causal``, ``kind`` and ``recomputed``: see :class:`Entry`.
    An op that has another rule already is refused (``ValueError``: an accidental second
    registration) unless ``replace=True``, which is how users override a built-in rule; registering
    the same entry again is a no-op. For one trace only, pass ``rules=`` to ``fxflops.trace`` /
    ``instrument`` instead (:func:`overlaid`).
    """
    _check_kind(kind)

    def decorator(rule: Rule) -> Rule:
        entry = Entry(rule, tuple(segments), causal, kind, recomputed)
        for op in ops:
            existing = _ENTRIES.get(_key(op))
            if existing is not None and existing != entry and not replace:
                raise ValueError(
                    f"{op} already has the FLOPs rule {_rule_name(existing.rule)}; pass replace=True to "
                    "override it, or rules={op: rule} to fxflops.trace/instrument for one trace"
                )
        for op in ops:
            _ENTRIES[_key(op)] = entry
        _VERSION[0] += 1
        return rule

    return decorator


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")


def _rule_name(rule: Rule) -> str:
    return f"{getattr(rule, '__module__', '?')}.{getattr(rule, '__qualname__', repr(rule))}"


_OVERLAY = threading.local()  # this thread's per-use rules (overlaid), while a trace is analysed


def per_use_entries(rules: Mapping[Any, Rule | Entry]) -> dict[Any, Entry]:
    """``rules`` (op -> a rule function or an :class:`Entry`) as registry entries by op key;
    ``TypeError``/``ValueError`` for a rule that is not callable or of an unknown kind."""
    entries = {}
    for op, rule in rules.items():
        entry = rule if isinstance(rule, Entry) else Entry(rule)
        _check_kind(entry.kind)
        if not callable(entry.rule):
            raise TypeError(f"the rule given for {op} is not callable: {entry.rule!r}")
        entries[_key(op)] = entry
    return entries


@contextlib.contextmanager
def overlaid(rules: Mapping[Any, Rule | Entry] | None) -> Iterator[None]:
    """For the block, in this thread only: ``rules`` (op -> a rule function, kind ``"matmul"``, or an
    :class:`Entry`) take precedence over the registry, which stays as it is (another thread's
    traces never see them). Ops are given as for :func:`register`."""
    if not rules:
        yield
        return
    entries = per_use_entries(rules)
    outer = getattr(_OVERLAY, "entries", None)
    _OVERLAY.entries = {**(outer or {}), **entries}
    try:
        yield
    finally:
        _OVERLAY.entries = outer


def unregister(*ops: Any) -> None:
    """Remove the rules of ``ops`` (no error for an op without one)."""
    for op in ops:
        _ENTRIES.pop(_key(op), None)
    _VERSION[0] += 1


def entry_for(op: Any) -> Entry | None:
    """The entry for ``op`` (its overload packet, or its ``namespace::name``): this thread's
    :func:`overlaid` rules first, then the registry; or ``None``."""
    for entries in (getattr(_OVERLAY, "entries", None) or {}, _ENTRIES):
        found = entries.get(_key(op))
        if found is None:
            found = entries.get(_name_key(op))
        if found is not None:
            return found
    return None


def rule_for(op: Any) -> Rule | None:
    """The rule registered for ``op``, or ``None``."""
    entry = entry_for(op)
    return entry.rule if entry is not None else None


def segment_args(op: Any) -> tuple[int | str, ...]:
    """Positions or names of ``op``'s arguments that are segment offsets (empty for most ops)."""
    entry = entry_for(op)
    return entry.segments if entry is not None else ()


def registered_ops() -> list[Any]:
    """Every op key that has a rule, in registration order."""
    return list(_ENTRIES)


def shape_of(value: Any) -> Any:
    """Replace tensors in ``value`` (possibly nested in lists/tuples) by their shapes as tuples."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return type(value)(shape_of(v) for v in value)
    return value
