"""The field's hand-written FLOPs formulas, as exact arithmetic (ints, Fractions or sympy expressions).

These are the formulas that training frameworks log as "model FLOPs" (see ``FORMULAS.md``); ``fxflops``
compares them with the FLOPs of the traced graph. Each function cites its source in its docstring.

- :mod:`fxflops.formulas.megatron`: Megatron-LM / Megatron-Bridge GPT training FLOPs (dense, GQA, MoE, MTP) and
  the Bridge ViT terms (exact and legacy).
- :mod:`fxflops.formulas.palm`: PaLM App. B / nanoGPT ``estimate_mfu`` and torchtitan (6N + 12·L·n·d·T), with
  the parameter counts they use.
- :mod:`fxflops.formulas.hf`: Hugging Face ``floating_point_ops`` (6·N·tokens).
"""

from fxflops.formulas.hf import hf_floating_point_ops
from fxflops.formulas.megatron import (
    gpt_training_flops,
    moe_layer_pattern,
    padded_vocab,
    vision_patch_stats,
    vit_training_flops,
    vit_training_flops_legacy,
)
from fxflops.formulas.palm import (
    non_embedding_params,
    palm_flops_per_iter,
    palm_flops_per_token,
    params_excluding,
    torchtitan_flops_per_token,
    torchtitan_moe_active_params,
)

__all__ = [
    "gpt_training_flops",
    "hf_floating_point_ops",
    "moe_layer_pattern",
    "non_embedding_params",
    "padded_vocab",
    "palm_flops_per_iter",
    "palm_flops_per_token",
    "params_excluding",
    "torchtitan_flops_per_token",
    "torchtitan_moe_active_params",
    "vision_patch_stats",
    "vit_training_flops",
    "vit_training_flops_legacy",
]
