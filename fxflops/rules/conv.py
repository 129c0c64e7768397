"""FLOPs rules for convolutions (1d/2d/3d, strided, padded, dilated, grouped, transposed) and their backward.

Convention (as ``torch.utils.flop_counter``): one multiply-add = 2 FLOPs; the bias add is not counted;
products with zero padding are counted (dense kernels compute them). The weight's shape already folds
in the groups: (C_out, C_in/groups, *kernel) for a convolution, (C_in, C_out/groups, *kernel) for a
transposed one, so in both cases every weight element meets every batch element once per position of
the side the kernel slides over:

- convolution: each output position gathers ``numel(weight)/C_out`` inputs for each of C_out channels
  -> 2·N·numel(weight)·numel(out spatial) = 2·N·out_spatial·C_out·(C_in/groups)·kernel;
- transposed convolution: each *input* position scatters into ``numel(weight)/C_in`` outputs for each
  of its C_in channels (the column-to-image form every backend uses, whose scattered products include
  the ones later cropped by ``padding``) -> 2·N·numel(weight)·numel(input spatial).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch

from fxflops.rules.registry import register

aten = torch.ops.aten


def _product(sizes: Sequence[Any]) -> Any:
    """Product of ``sizes`` (ints or sympy expressions); 1 for an empty sequence."""
    return functools.reduce(operator.mul, sizes, 1)


def _conv_flops(input_shape, weight_shape, output_shape, transposed):
    """2·N·numel(weight)·numel(spatial), spatial of the input if ``transposed`` else of the output."""
    sliding_shape = input_shape if transposed else output_shape
    return 2 * input_shape[0] * _product(weight_shape) * _product(sliding_shape[2:])


@register(aten.convolution, aten._convolution, aten.convolution_overrideable)
def convolution(input, weight, bias, stride, padding, dilation, transposed, *args, out_shape=None, **kwargs):
    """convolution: 2·N·C_out·(C_in/groups)·kernel·out_spatial; transposed: the same with in_spatial.

    Both are 2·N·numel(weight)·numel(spatial) (see the module docstring).
    Source: torch/utils/flop_counter.py ``conv_flop_count`` (same numbers for the forward).
    """
    return _conv_flops(input, weight, out_shape, transposed)


@register(
    aten.cudnn_convolution,
    aten.mkldnn_convolution,
    aten.miopen_convolution,
    aten.miopen_depthwise_convolution,
    aten._slow_conv2d_forward,
    aten.slow_conv3d_forward,
    aten.slow_conv_dilated2d,
    aten.slow_conv_dilated3d,
    aten._conv_depthwise2d,
    aten.conv_depthwise3d,
)
def backend_convolution(self, weight, *args, out_shape=None, **kwargs):
    """Backend convolution kernels (never transposed): 2·N·numel(weight)·numel(out spatial).

    Source: torch/utils/flop_counter.py ``conv_flop_count``. FlopCounterMode reads these with the
    ``convolution`` signature: _slow_conv2d_forward raises TypeError there, and cudnn_convolution with
    ``benchmark=True`` is taken for a transposed convolution.
    """
    return _conv_flops(self, weight, out_shape, transposed=False)


@register(
    aten.cudnn_convolution_transpose,
    aten.miopen_convolution_transpose,
    aten.slow_conv_transpose2d,
    aten.slow_conv_transpose3d,
)
def backend_convolution_transpose(self, weight, *args, out_shape=None, **kwargs):
    """Backend transposed-convolution kernels: 2·N·numel(weight)·numel(input spatial).

    Source: torch/utils/flop_counter.py ``conv_flop_count`` with ``transposed=True``.
    """
    return _conv_flops(self, weight, out_shape, transposed=True)


def _conv_backward_flops(grad_output, input, weight, transposed, output_mask):
    """(output_mask[0] + output_mask[1]) × forward FLOPs; the bias gradient is a sum, not counted."""
    forward = _conv_flops(input, weight, grad_output, transposed)
    return (int(output_mask[0]) + int(output_mask[1])) * forward


@register(aten.convolution_backward)
def convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
    output_mask, *args, out_shape=None, **kwargs,
):
    """convolution_backward: forward FLOPs for grad_input plus forward FLOPs for grad_weight.

    grad_input is the transposed operation of the forward (a transposed conv of grad_output for a
    conv, a conv for a transposed conv): every weight element meets every grad_output position
    (conv) / every input position (transposed conv) once, as in the forward. grad_weight correlates
    input with grad_output within each group: one multiply-add per (n, c_out, c_in/groups, kernel,
    position), again the forward count. Both hold for any ``groups``.
    Source: torch/utils/flop_counter.py ``conv_backward_flop`` for groups = 1; its grad_weight term
    drops the 1/groups (groups × forward), which this rule corrects.
    """
    return _conv_backward_flops(grad_output, input, weight, transposed, output_mask)


@register(aten.convolution_backward_overrideable)
def convolution_backward_overrideable(
    grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask,
    *args, out_shape=None, **kwargs,
):
    """convolution_backward_overrideable: as convolution_backward (its schema has no ``bias_sizes``)."""
    return _conv_backward_flops(grad_output, input, weight, transposed, output_mask)
