"""Marker ops: nodes a capture puts in the graph where it did not trace a module's own ops.

Two capture-time shortcuts leave markers instead of the module's ops, and the analysis bills them:

- a **per-segment** module (``capture/lifting.py``) is traced once on one segment; each of its outputs
  in the outer graph is a ``fxflops::per_segment`` node, and in a joint capture the gradient it sends
  to its packed input is a ``fxflops::per_segment_grad`` node::

      before:  q = ...; out = attn(q, cu_seqlens)      # attn loops over cu_seqlens.tolist()
      after:   out = fxflops.per_segment(q, cu_seqlens, [P, 1280], float32, bill=True, call=0)
               ...
               dq = fxflops.per_segment_grad(d_out, q, call=0)   # only if its backward ran

- a **repeated layer** (``capture/reuse.py``) that matches a traced layer exactly is a
  ``fxflops::repeat_layer`` node per output (``fxflops::repeat_layer_grad`` for its backward)::

      before:  h1 = layers.0(h0); h2 = layers.1(h1)
      after:   h1 = layers.0(h0); h2 = fxflops.repeat_layer(h1, [B, S, D], float32, "layers.1")

The ops never run for real (only their fake kernels, inside a capture). The accessors below are the
one place that knows their argument positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@torch.library.custom_op("fxflops::per_segment", mutates_args=())
def per_segment_marker(
    packed: torch.Tensor, offsets: torch.Tensor, shape: list[int], dtype: torch.dtype, bill: bool, call: int
) -> torch.Tensor:
    """A lifted module's output inside a captured graph (``bill``: this node carries its FLOPs;
    ``call`` numbers the module's calls within the capture)."""
    raise RuntimeError("fxflops::per_segment only exists inside a capture")


@per_segment_marker.register_fake
def _(packed, offsets, shape, dtype, bill, call):
    return packed.new_empty(shape, dtype=dtype)


@torch.library.custom_op("fxflops::per_segment_grad", mutates_args=())
def per_segment_grad(grad: torch.Tensor, packed: torch.Tensor, call: int) -> torch.Tensor:
    """The gradient a lifted module's ``call`` sends to its packed input, inside a joint capture (never
    runs for real): the module's backward FLOPs, from its own one-segment joint trace, are billed
    where this node is (once per call whose backward ran)."""
    raise RuntimeError("fxflops::per_segment_grad only exists inside a capture")


@per_segment_grad.register_fake
def _(grad, packed, call):
    return torch.empty_like(packed)


def _segment_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.call = inputs[5]


def _segment_backward(ctx, grad):
    (packed,) = ctx.saved_tensors
    return per_segment_grad(grad, packed, ctx.call), None, None, None, None, None


per_segment_marker.register_autograd(_segment_backward, setup_context=_segment_setup)


@torch.library.custom_op("fxflops::repeat_layer", mutates_args=())
def repeat_marker(input: torch.Tensor, shape: list[int], dtype: torch.dtype, layer: str) -> torch.Tensor:
    """An output of a layer billed as a repeat of a traced one (exists only inside a capture)."""
    raise RuntimeError("fxflops::repeat_layer only exists inside a capture")


@repeat_marker.register_fake
def _(input, shape, dtype, layer):
    return input.new_empty(shape, dtype=dtype)


@torch.library.custom_op("fxflops::repeat_layer_grad", mutates_args=())
def repeat_grad(grad: torch.Tensor, input: torch.Tensor, layer: str) -> torch.Tensor:
    """The gradient a repeated layer sends to its input (its backward FLOPs are the template's)."""
    raise RuntimeError("fxflops::repeat_layer_grad only exists inside a capture")


@repeat_grad.register_fake
def _(grad, input, layer):
    return torch.empty_like(input)


def _repeat_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.layer = inputs[3]


def _repeat_backward(ctx, grad):
    (input,) = ctx.saved_tensors
    return repeat_grad(grad, input, ctx.layer), None, None, None


repeat_marker.register_autograd(_repeat_backward, setup_context=_repeat_setup)

PER_SEGMENT = torch.ops.fxflops.per_segment.default
PER_SEGMENT_GRAD = torch.ops.fxflops.per_segment_grad.default
REPEAT = torch.ops.fxflops.repeat_layer.default
REPEAT_GRAD = torch.ops.fxflops.repeat_layer_grad.default
MARKERS = frozenset({PER_SEGMENT, PER_SEGMENT_GRAD, REPEAT, REPEAT_GRAD})


@dataclass(frozen=True)
class SegmentOutput:
    """One output of a per-segment module's call: the packed input and offsets it was called with,
    whether this output bills the call's FLOPs (the first one does), and the call's number."""

    packed: torch.fx.Node
    offsets: torch.fx.Node
    bills: bool
    call: int


def is_marker(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in MARKERS


def segment_output(node: torch.fx.Node) -> SegmentOutput | None:
    """The arguments of a ``fxflops::per_segment`` node (None for any other node)."""
    if node.op != "call_function" or node.target is not PER_SEGMENT:
        return None
    packed, offsets, _shape, _dtype, bills, call = node.args
    return SegmentOutput(packed, offsets, bills, call)


def segment_backward_call(node: torch.fx.Node) -> int | None:
    """The call number of a ``fxflops::per_segment_grad`` node: that call's backward ran."""
    if node.op != "call_function" or node.target is not PER_SEGMENT_GRAD:
        return None
    return node.args[2]


def repeated_layer(node: torch.fx.Node) -> tuple[str, bool] | None:
    """(layer path, is the backward) of a ``fxflops::repeat_layer(_grad)`` node, else None."""
    if node.op != "call_function" or node.target not in (REPEAT, REPEAT_GRAD):
        return None
    return node.args[-1], node.target is REPEAT_GRAD
