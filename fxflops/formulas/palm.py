"""The 6N + 12·L·H·Q·T family: PaLM Appendix B, nanoGPT ``estimate_mfu`` and torchtitan.

Sources (FORMULAS.md §2.3 and §5, written from the math, no code copied):

- PaLM (Chowdhery et al. 2022), Appendix B "Compute usage and model FLOPs utilization": per token,
  6N for the parameter matmuls (forward 2N, backward 4N) plus 12·L·H·Q·T for self-attention
  (QKᵀ and P·V, ×2 for the FMA, ×3 for forward + backward), with no causal halving.
- nanoGPT ``model.py`` ``GPT.estimate_mfu``: the same formula with N = all parameters minus the position
  embedding ``wpe`` (the token embedding stays in N because it is tied to the lm_head), Q = n_embd/H,
  T = block_size (static, no padding awareness); flops per iteration = flops_per_token · T · fwdbwd_per_iter,
  MFU against 312e12 (A100 bf16).
- torchtitan ``get_dense_model_nparams_and_flops`` (llama3, qwen3, ...): per token 6·N + 6·L·n·(2·d)·T, i.e.
  6N + 12·L·n·d·T, with N = all parameters minus ``nn.Embedding`` parameters (kept when tied to the output),
  T = ``training.max_context_length`` and no causal halving (an explicit comment there). Its MoE variant
  counts the routed experts at topk/E (:func:`torchtitan_moe_active_params`); vision parameters are excluded.

Compared with Megatron (:func:`fxflops.formulas.gpt_training_flops`), the attention term is 2× (no causal
halving) and uses the static context length instead of each sequence's length.

All formulas are pure arithmetic (ints, Fractions or sympy expressions; floats refused).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fxflops.formulas.megatron import _exact_div, _no_floats, _normalize

__all__ = [
    "non_embedding_params",
    "palm_flops_per_iter",
    "palm_flops_per_token",
    "params_excluding",
    "torchtitan_flops_per_token",
    "torchtitan_moe_active_params",
]


def palm_flops_per_token(*, n_params: Any, layers: Any, heads: Any, head_dim: Any, seq: Any) -> Any:
    """Training FLOPs per token: ``6·N + 12·L·H·Q·T`` (PaLM App. B; nanoGPT ``estimate_mfu``).

    N = ``n_params`` (for nanoGPT: all parameters minus the position embedding, see :func:`params_excluding`),
    L = ``layers``, H = ``heads``, Q = ``head_dim``, T = ``seq`` (nanoGPT: ``block_size``). The attention term is
    not halved for causality and uses the full T for every token.
    """
    _no_floats(**locals())
    return _normalize(6 * n_params + 12 * layers * heads * head_dim * seq)


def palm_flops_per_iter(*, flops_per_token: Any, seq: Any, fwdbwd_per_iter: Any) -> Any:
    """nanoGPT ``estimate_mfu``'s FLOPs per iteration: ``flops_per_token · T · fwdbwd_per_iter``.

    ``seq`` = T (``block_size``), ``fwdbwd_per_iter`` = sequences per optimizer step (batch size × gradient
    accumulation steps). nanoGPT divides this by the iteration time and by 312e12 for the MFU; those are
    measured floats and left to the caller.
    """
    _no_floats(**locals())
    return _normalize(flops_per_token * seq * fwdbwd_per_iter)


def torchtitan_flops_per_token(*, n_matmul_params: Any, layers: Any, heads: Any, head_dim: Any, seq: Any) -> Any:
    """Training FLOPs per token as torchtitan logs them: ``6·N + 12·L·n·d·T``.

    Source: torchtitan ``get_dense_model_nparams_and_flops`` (FORMULAS.md §5), written there as
    ``6·N + 6·L·n·head_dims·T`` with ``head_dims = 2·d`` (QKᵀ plus PV "combined"). N = ``n_matmul_params``: all
    parameters minus ``nn.Embedding`` parameters, kept when the embedding is tied to the output
    (:func:`non_embedding_params`); for MoE use :func:`torchtitan_moe_active_params`. L = ``layers`` (for MoE /
    hybrid models: only the layers that have attention), n = ``heads``, d = ``head_dim``, T = ``seq``
    (``training.max_context_length``, static). No causal halving (a deliberate comment in torchtitan); no
    vision-encoder term (a TODO there). torchtitan's ``tflops = flops_per_token · tps / 1e12`` is per device.
    """
    _no_floats(**locals())
    return _normalize(6 * n_matmul_params + 12 * layers * heads * head_dim * seq)


def torchtitan_moe_active_params(
    *, non_routed_params: Any, routed_expert_params: Any, topk: Any, num_experts: Any
) -> Any:
    """torchtitan's MoE N: ``N_non_routed + N_routed · topk / E`` (``get_moe_model_nparams_and_flops``).

    ``non_routed_params`` = dense non-embedding parameters including the router and shared experts;
    ``routed_expert_params`` = all routed-expert parameters of all layers; each token activates topk of the
    E = ``num_experts`` experts. Exact (a Fraction or sympy Rational when topk/E does not divide).
    """
    _no_floats(**locals())
    return _normalize(non_routed_params + _exact_div(routed_expert_params * topk, num_experts))


def params_excluding(model: nn.Module, excluded_modules: Iterable[nn.Module]) -> int:
    """Number of parameters of ``model`` that are not owned by any module in ``excluded_modules``.

    Each distinct parameter object counts once (a parameter shared by two modules is one parameter). A
    parameter is dropped only if *every* module that owns it directly is excluded: a weight tied between an
    excluded module and a kept one (an ``nn.Embedding`` shared with a ``Linear`` lm_head) is kept.
    nanoGPT's N is ``params_excluding(gpt, [gpt.transformer.wpe])`` (all parameters minus the position
    embedding; the tied ``wte`` stays as the lm_head). Works on the ``meta`` device (only ``numel`` is read).
    """
    excluded_ids = {id(module) for module in excluded_modules}
    kept: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(module) not in excluded_ids:
                kept[id(param)] = param
    return sum(param.numel() for param in kept.values())


def non_embedding_params(model: nn.Module) -> int:
    """All parameters of ``model`` minus those of its ``nn.Embedding`` modules (torchtitan's N_matmul).

    Source: torchtitan ``get_dense_model_nparams_and_flops`` (FORMULAS.md §5): N = all parameters minus
    ``nn.Embedding`` parameters, with the embedding kept when its weight is tied to the output projection.
    Tied-weight handling: a weight shared between an ``nn.Embedding`` and a non-embedding module (the usual tied
    lm_head) counts once, as a matmul parameter; shared parameters are never counted twice. Unlike torchtitan
    (which looks at the model's direct children), embeddings anywhere in the module tree are excluded. On a
    nanoGPT model this equals nanoGPT's own N (wpe excluded, the tied wte kept as the lm_head).
    HF's ``num_parameters(exclude_embeddings=True)`` differs on tied models: it drops the tied weight.
    """
    return params_excluding(model, [m for m in model.modules() if isinstance(m, nn.Embedding)])
