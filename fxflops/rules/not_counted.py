"""Ops whose work the FlopCounterMode / MFU convention does not count.

FlopCounterMode (torch/utils/flop_counter.py) and the MFU formulas of Megatron, PaLM and torchtitan
count matrix products only: matmul, convolution and attention. Elementwise math, reductions,
normalisation, softmax, pooling, data movement and indexing are real work on the device, but the
convention leaves them out. fxflops classifies every traced op into exactly one of:

* **counted**: a rule is registered (``registry.rule_for(op)`` is not ``None``);
* **not counted by convention**: :func:`is_not_counted` below is true;
* **unsupported**: anything else that touches floating-point tensors (a custom op, ``linalg``, FFT, ...).
  Those are listed in ``Program.unsupported`` and warned about, never silently taken as zero.
"""

from __future__ import annotations

from typing import Any

import torch

# Named by overload packet. Each group is work the matmul-only convention leaves out.
_NOT_COUNTED_NAMES = frozenset(
    # normalisation, softmax and their backward
    "native_layer_norm native_group_norm native_batch_norm _native_batch_norm_legit "
    "_native_batch_norm_legit_no_training _native_batch_norm_legit_functional batch_norm "
    "_batch_norm_with_update _batch_norm_no_update _fused_rms_norm "
    "native_layer_norm_backward native_group_norm_backward native_batch_norm_backward "
    "batch_norm_backward _fused_rms_norm_backward "
    "_softmax _log_softmax _safe_softmax _softmax_backward_data _log_softmax_backward_data "
    # pooling and resampling
    "max_pool2d_with_indices max_pool3d_with_indices avg_pool2d avg_pool3d _adaptive_avg_pool2d "
    "_adaptive_avg_pool3d adaptive_max_pool2d max_pool2d_with_indices_backward avg_pool2d_backward "
    "_adaptive_avg_pool2d_backward upsample_nearest1d upsample_nearest2d upsample_nearest3d "
    "upsample_bilinear2d upsample_bicubic2d upsample_linear1d upsample_trilinear3d "
    "_upsample_nearest_exact2d grid_sampler_2d "
    # cumulative ops, sorting, selection
    "cumsum cumprod logcumsumexp sort topk kthvalue median searchsorted bucketize "
    # data movement, creation, copies
    "cat stack split_with_sizes _to_copy copy copy_ clone contiguous repeat repeat_interleave roll flip "
    "constant_pad_nd reflection_pad1d reflection_pad2d replication_pad2d tril triu "
    "empty empty_like empty_strided new_empty new_empty_strided zeros zeros_like ones ones_like "
    "full full_like new_full new_zeros new_ones arange linspace scalar_tensor lift_fresh_copy eye "
    "fill fill_ zero_ masked_fill masked_fill_ index_fill "
    # indexing, gather/scatter, embedding
    "embedding embedding_dense_backward index index_put index_put_ _unsafe_index _unsafe_index_put "
    "index_select gather scatter scatter_add scatter_reduce index_add index_copy "
    "_unsafe_view alias detach masked_scatter masked_select slice_scatter select_scatter diagonal_scatter "
    "_unsafe_masked_index _unsafe_masked_index_put_accumulate "
    # randomness and dropout
    "native_dropout native_dropout_backward bernoulli bernoulli_ rand rand_like randn randn_like "
    "randint randint_like randperm uniform uniform_ normal normal_ "
    # backward of data movement and indexing
    "slice_backward select_backward index_select_backward diagonal_backward unfold_backward "
    "masked_scatter_backward "
    # patches cut out and put back (F.unfold / F.fold; Llama 4's patch embedding): gathers and scatter-adds
    "im2col col2im "
    "as_strided_scatter expand_copy "
    # losses (their matmul-free arithmetic)
    "nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward mse_loss "
    "mse_loss_backward binary_cross_entropy binary_cross_entropy_with_logits smooth_l1_loss "
    "_local_scalar_dense".split()
)


def _floating_tensors(values: Any) -> bool:
    """True if any tensor (FakeTensor or real) in ``values`` has a floating or complex dtype."""
    if isinstance(values, torch.Tensor):
        return values.dtype.is_floating_point or values.dtype.is_complex
    if isinstance(values, (list, tuple)):
        return any(_floating_tensors(v) for v in values)
    return False


def _has_tensor(values: Any) -> bool:
    if isinstance(values, (list, tuple)):
        return any(_has_tensor(v) for v in values)
    return isinstance(values, torch.Tensor)


def touches_floats(inputs: Any, output: Any) -> bool:
    """True if the op makes a tensor and reads or writes floating-point tensors.

    Only such ops can be unsupported: size queries (``sym_size``) and integer index math do no
    floating-point work.
    """
    return _has_tensor(output) and (_floating_tensors(output) or _floating_tensors(inputs))  # the output first: mostly decides


def is_not_counted(op: Any) -> bool:
    """True if ``op`` is work the matmul-only convention does not count (see module docstring).

    Pointwise and reduction ops are recognised by their ATen tags, views by an aliasing return in
    their schema, everything else by name in the list above.
    """
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.pointwise in op.tags or torch.Tag.reduction in op.tags:
        return True
    if any(ret.alias_info is not None for ret in op._schema.returns):
        return True
    return op.overloadpacket.__name__ in _NOT_COUNTED_NAMES
