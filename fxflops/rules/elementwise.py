"""Per-op costs of the work the matmul-only convention leaves out, counted under ``count="all"``.

These are documented conventions, not instruction counts (a transcendental costs many instructions):

* pointwise ops (ATen ``Tag.pointwise``: add, mul, exp, gelu, silu, where, ...): 1 FLOP per output
  element; reductions (``Tag.reduction``: sum, mean, amax, var_mean, ...): 1 FLOP per input element;
* softmax and log-softmax: 5 per element (max, subtract, exp, sum, divide or log); their backward 4
  per element (multiply, sum, subtract, multiply);
* layer/group/batch norm: 5 per element to normalise (mean, subtract, square, mean, scale), plus 1 per
  element for the weight and 1 for the bias when present; RMSNorm 3 per element (+1 weight); their
  backward twice the forward;
* embedding gathers (kind ``"embedding"``, counted only with ``embeddings=True``): 1 per gathered
  element; the embedding backward 1 per gradient element (a scatter-add).

Ops that only move or index data stay at 0 (``not_counted.py``), also the ones ATen tags pointwise
(``clone``, ``_to_copy``, ``copy_``, ``fill``, ``masked_fill``: :data:`MOVES_DATA`).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from fxflops.rules.registry import register

aten = torch.ops.aten


def numel(shape) -> Any:
    """Number of elements of a shape (a tuple of ints or sympy expressions)."""
    total = 1
    for size in shape:
        total = total * size
    return total


MOVES_DATA = frozenset(
    "clone _to_copy copy copy_ fill fill_ masked_fill masked_fill_ zero_ lift_fresh_copy alias detach".split()
)  # tagged pointwise by ATen, but they copy, cast or fill: no arithmetic


def elementwise_cost(op: Any, out_shape: Any, first_shape: Any) -> Any | None:
    """Cost of a pointwise (1 per output element) or reduction (1 per input element) op without a
    registered rule (0 for one that only moves data), or ``None`` for any other op. ``out_shape`` and
    ``first_shape`` are the shapes of the output and of the first argument (``None`` where that is not
    a tensor): traced (sympy) or concrete (ints, a measured call's ops: ``fxflops/islands.py``)."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if op._schema.name.split("::")[-1] in MOVES_DATA:
        return 0
    if torch.Tag.pointwise in op.tags:
        return numel(out_shape) if isinstance(out_shape, tuple) else 0
    if torch.Tag.reduction in op.tags:
        return numel(first_shape) if isinstance(first_shape, tuple) else 0
    return None


def elementwise_flops(op: Any, node: torch.fx.Node, named: Any) -> sympy.Expr | None:
    """:func:`elementwise_cost` of a graph node, in the public symbols (``named``)."""
    def shape(value: Any) -> tuple | None:
        return tuple(named(d) for d in value.shape) if isinstance(value, torch.Tensor) else None

    first = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    cost = elementwise_cost(op, shape(node.meta.get("val")), shape(first))
    return None if cost is None else sympy.sympify(cost)


@register(aten.polar, kind="elementwise")
def polar(abs, angle, *args, out_shape=None, **kwargs):
    """torch.polar (abs·cos θ + i·abs·sin θ; rotary tables): pointwise, 1 per output element (ATen
    does not tag it pointwise)."""
    return numel(out_shape)


@register(aten._softmax, aten._log_softmax, aten._safe_softmax, kind="elementwise")
def softmax(self, *args, out_shape=None, **kwargs):
    """softmax / log_softmax: 5 per element (max, subtract, exp, sum, divide or log)."""
    return 5 * numel(self)


@register(aten._softmax_backward_data, aten._log_softmax_backward_data, kind="elementwise")
def softmax_backward(grad_output, *args, out_shape=None, **kwargs):
    """softmax / log_softmax backward: 4 per element."""
    return 4 * numel(grad_output)


def _norm_flops(input, weight, bias):
    """5 per element to normalise, +1 for an affine weight, +1 for a bias."""
    return numel(input) * (5 + (weight is not None) + (bias is not None))


@register(aten._fused_rms_norm, kind="elementwise")
def rms_norm(input, normalized_shape, weight=None, *args, out_shape=None, **kwargs):
    """fused RMSNorm: 3 per element (square, mean, scale by the reciprocal root), +1 for the weight."""
    return numel(input) * (3 + (weight is not None))


@register(aten._fused_rms_norm_backward, kind="elementwise")
def rms_norm_backward(grad_out, input, normalized_shape, rstd, weight=None, *args, out_shape=None, **kwargs):
    """fused RMSNorm backward: twice the forward."""
    return 2 * numel(input) * (3 + (weight is not None))


@register(aten.native_layer_norm, kind="elementwise")
def layer_norm(input, normalized_shape, weight=None, bias=None, *args, out_shape=None, **kwargs):
    """native_layer_norm: 5 per element (+1 weight, +1 bias)."""
    return _norm_flops(input, weight, bias)


@register(aten.native_group_norm, aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training, aten._native_batch_norm_legit_functional, kind="elementwise")
def group_or_batch_norm(input, weight=None, bias=None, *args, out_shape=None, **kwargs):
    """group / batch norm: 5 per element (+1 weight, +1 bias)."""
    return _norm_flops(input, weight, bias)


@register(aten.native_layer_norm_backward, kind="elementwise")
def layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight=None, bias=None, *args, out_shape=None, **kwargs):
    """native_layer_norm backward: twice the forward."""
    return 2 * _norm_flops(input, weight, bias)


@register(aten.native_group_norm_backward, kind="elementwise")
def group_norm_backward(grad_out, input, mean, rstd, weight=None, *args, out_shape=None, **kwargs):
    """native_group_norm backward: twice the forward (its schema has no bias)."""
    return 2 * _norm_flops(input, weight, weight)


@register(aten.native_batch_norm_backward, kind="elementwise")
def batch_norm_backward(grad_out, input, weight=None, *args, out_shape=None, **kwargs):
    """native_batch_norm backward: twice the forward (weight and bias together)."""
    return 2 * _norm_flops(input, weight, weight)


@register(aten.embedding, kind="embedding")
def embedding(weight, indices, *args, out_shape=None, **kwargs):
    """embedding: 1 per gathered element (rows × width)."""
    return numel(indices) * weight[-1]


@register(aten.embedding_dense_backward, kind="embedding")
def embedding_backward(grad_output, indices, *args, out_shape=None, **kwargs):
    """embedding backward: 1 per gradient element (a scatter-add)."""
    return numel(grad_output)


@register(aten._embedding_bag, aten._embedding_bag_forward_only, kind="elementwise")
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False, per_sample_weights=None, *args, out_shape=None, **kwargs):
    """embedding_bag (a weighted gather, e.g. interpolation taps of a position table): per gathered
    element (indices × width) an add into its bag, and a multiply by its weight when
    ``per_sample_weights`` is given; mode mean (1) divides each output element."""
    gathered = numel(indices) * weight[-1]
    return gathered * (2 if per_sample_weights is not None else 1) + (numel(out_shape[0]) if mode == 1 else 0)


@register(aten._embedding_bag_backward, aten._embedding_bag_dense_backward, kind="elementwise")
def embedding_bag_backward(grad, indices, *args, out_shape=None, **kwargs):
    """embedding_bag backward to the table: each gathered element's gradient (width per index)
    scattered back with an add, times its weight when the bag was weighted."""
    weighted = kwargs.get("per_sample_weights", args[8] if len(args) > 8 else None) is not None
    return numel(indices) * grad[-1] * (2 if weighted else 1)


@register(aten._embedding_bag_per_sample_weights_backward, kind="elementwise")
def embedding_bag_weights_backward(grad, weight, indices, *args, out_shape=None, **kwargs):
    """embedding_bag backward to the per-sample weights: a dot product of width per index."""
    return 2 * numel(indices) * weight[-1]
