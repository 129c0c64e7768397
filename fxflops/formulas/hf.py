"""Hugging Face ``transformers`` FLOPs estimate: ``PreTrainedModel.floating_point_ops`` = 6·N·tokens.

Source: ``transformers`` ``modeling_utils.py`` (``ModuleUtilsMixin.floating_point_ops`` with
``estimate_tokens`` and ``num_parameters(exclude_embeddings=True)``), which the ``Trainer`` accumulates into
``total_flos``; the 6·N·tokens rule is that of Kaplan et al. 2020 (2N forward + 4N backward per token, attention
ignored). Written from that math (FORMULAS.md "Bugs the field shipped"), no code copied.
"""

from __future__ import annotations

from typing import Any

from fxflops.formulas.megatron import _no_floats, _normalize

__all__ = ["hf_floating_point_ops"]


def hf_floating_point_ops(*, n_params: Any, tokens: Any) -> Any:
    """``6 · N · tokens``: the training FLOPs HF ``floating_point_ops`` reports for one batch.

    ``n_params`` = N, HF's ``num_parameters(exclude_embeddings=True)`` (all parameters minus those named as
    ``nn.Embedding`` weights; with a tied lm_head the shared weight is dropped too, unlike torchtitan);
    ``tokens`` = HF's ``estimate_tokens``: the element count of the main input (``input_ids``), padding
    included. Attention's s² term, the logits of a tied head and any per-sequence structure are ignored.

    Known bug for vision-language models: N includes the vision tower's parameters, and they are billed once
    per *text* token (the count of ``input_ids``), while the vision tower actually runs once per image patch
    (``pixel_values`` are not counted as tokens). The result therefore scales the vision cost with the text
    length instead of the patch count, typically far off in either direction; use
    :func:`fxflops.formulas.vit_training_flops` with the real patch statistics instead.

    Pure arithmetic: ints, Fractions or sympy expressions (floats refused).
    """
    _no_floats(**locals())
    return _normalize(6 * n_params * tokens)
