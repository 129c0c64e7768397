"""Megatron-LM / Megatron-Bridge training FLOPs (the "MODEL_TFLOP/s" numerator), written from the math.

Sources: Megatron-LM ``megatron/training/training.py`` ``num_floating_point_operations`` and
Megatron-Bridge ``training/utils/flop_utils.py`` (transformer path and the ViT terms), as condensed in
``FORMULAS.md`` §1, §2.2 and §2.5. No code was copied; every function below is the written math.

Conventions of those sources (FORMULAS.md §1): a GEMM m×n by n×k costs 2mnk FLOPs; training is ×3 on every
GEMM (forward, dgrad, wgrad), with nothing added for activation or flash-attention recompute; the attention core
counts only QKᵀ and P·V; causal attention is halved (s²/2, not s(s+1)/2); biases, norms, activations, softmax,
RoPE, the input embedding lookup, the router GEMM and the cross-entropy are not counted.

Every function is pure arithmetic on its arguments, so it gives the same answer for Python ``int`` /
:class:`fractions.Fraction` arguments and for sympy expressions (``fxflops.verify`` passes symbols and compares
polynomials). Floats are refused: they would make "exact" results inexact. Rounding (vocabulary padding, the
merged-patch floor) is applied only to integer data or configuration values, never to symbols.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import sympy

__all__ = [
    "gpt_training_flops",
    "moe_layer_pattern",
    "padded_vocab",
    "vision_patch_stats",
    "vit_training_flops",
    "vit_training_flops_legacy",
]


# --------------------------------------------------------------------------------------------- helpers


def _no_floats(**values: Any) -> None:
    """Raise ``TypeError`` if any value is a float or a sympy expression containing a Float."""
    for name, value in values.items():
        if isinstance(value, float) or (isinstance(value, sympy.Basic) and value.atoms(sympy.Float)):
            raise TypeError(
                f"{name}={value!r} is a float; pass an int, a fractions.Fraction or a sympy expression "
                "so that the result stays exact"
            )


def _exact_div(numerator: Any, denominator: Any) -> Any:
    """``numerator / denominator`` without floats: a sympy expression if either side is symbolic, else an int
    when the division is exact and a :class:`~fractions.Fraction` otherwise."""
    if isinstance(numerator, sympy.Basic) or isinstance(denominator, sympy.Basic):
        return sympy.sympify(numerator) / sympy.sympify(denominator)
    return _normalize(Fraction(numerator) / Fraction(denominator))


def _normalize(value: Any) -> Any:
    """A :class:`~fractions.Fraction` with denominator 1 becomes an ``int``; anything else is returned as is."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return value.numerator
    return value


def _as_int(name: str, value: Any) -> int:
    """``value`` as a Python int (ints, sympy Integers, 0-d integer tensors); ``TypeError`` for anything else,
    in particular for symbols, where a floor or ceil would not be pure arithmetic."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool")
    if isinstance(value, Fraction):
        if value.denominator != 1:
            raise TypeError(f"{name}={value} must be an integer")
        return value.numerator
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name}={value!r} must be a concrete integer here (a floor/ceil is applied to it); "
            "symbols are only accepted where the formula is a polynomial"
        ) from None


# --------------------------------------------------------------------------------------------- vocab, layers


def padded_vocab(vocab: Any, make_vocab_size_divisible_by: int = 128, tensor_parallel: int = 1) -> Any:
    """Vocabulary size as padded by Megatron: ``V_pad = ceil(V / (div·TP)) · div·TP``.

    Source: Megatron-LM ``_vocab_size_with_padding`` as used by ``num_floating_point_operations`` and
    Megatron-Bridge ``flop_utils.py`` (FORMULAS.md §1, "logits"); ``div`` = ``make_vocab_size_divisible_by``
    (default 128), TP = tensor-parallel size. The logits GEMM is billed on the padded width.

    ``vocab`` must be a concrete integer, because of the ceiling. The one exception: when ``div·TP == 1``
    there is no padding and a symbolic ``vocab`` is returned unchanged.
    """
    multiple = _as_int("make_vocab_size_divisible_by", make_vocab_size_divisible_by) * _as_int(
        "tensor_parallel", tensor_parallel
    )
    if multiple < 1:
        raise ValueError(f"make_vocab_size_divisible_by·tensor_parallel must be >= 1, got {multiple}")
    if multiple == 1 and isinstance(vocab, sympy.Basic) and not vocab.is_Integer:
        return vocab
    v = _as_int("vocab", vocab)
    return -(-v // multiple) * multiple


def moe_layer_pattern(*, layers: int, moe_layer_freq: int | Sequence[int]) -> list[int]:
    """Megatron's MoE layer pattern: 1 = MoE layer, 0 = dense, one entry per decoder layer.

    Source: FORMULAS.md §2.2 "Layer types" (Megatron-LM / Bridge ``moe_layer_freq``): an int ``k`` makes layer
    ``i`` (0-based) MoE iff ``i % k == 0`` (so layer 0 is always MoE); a list is used as is. Feed the result to
    :func:`gpt_training_flops` as ``moe_layers=sum(pattern)`` and ``mtp_moe=bool(pattern[-1])`` (the MTP layers
    take the type of the last pattern entry).
    """
    n_layers = _as_int("layers", layers)
    if isinstance(moe_layer_freq, (list, tuple)):
        pattern = [_as_int("moe_layer_freq[i]", x) for x in moe_layer_freq]
        if len(pattern) != n_layers or any(x not in (0, 1) for x in pattern):
            raise ValueError(f"moe_layer_freq list must be {n_layers} entries of 0/1, got {pattern}")
        return pattern
    k = _as_int("moe_layer_freq", moe_layer_freq)
    if k < 1:
        raise ValueError(f"moe_layer_freq must be >= 1, got {k}")
    return [1 if i % k == 0 else 0 for i in range(n_layers)]


def _mtp_is_moe(layers: Any, moe_layers: Any, mtp_moe: bool | None) -> bool:
    if mtp_moe is not None:
        return bool(mtp_moe)
    if moe_layers == 0:
        return False
    if moe_layers == layers or (isinstance(moe_layers, sympy.Basic) and sympy.expand(moe_layers - layers) == 0):
        return True
    raise ValueError(
        "with MTP layers and a partly-MoE stack the MTP layer type is the type of the last decoder layer; "
        "pass mtp_moe=True/False (see moe_layer_pattern)"
    )


# --------------------------------------------------------------------------------------------- GPT


def gpt_training_flops(
    *,
    tokens: Any,
    sum_seq_squared: Any,
    layers: Any,
    hidden: Any,
    ffn_hidden: Any,
    heads: Any,
    query_groups: Any = None,
    kv_channels: Any = None,
    vocab: Any,
    glu: bool = True,
    make_vocab_size_divisible_by: int = 128,
    tensor_parallel: int = 1,
    moe_layers: Any = 0,
    moe_ffn_hidden: Any = None,
    moe_topk: Any = 1,
    shared_expert_ffn_hidden: Any = 0,
    moe_latent_size: Any = None,
    mtp_layers: Any = 0,
    mtp_moe: bool | None = None,
    attention_output_gate: bool = False,
) -> Any:
    """Training FLOPs (forward + backward) of a Megatron GPT batch, dense / GQA / MoE / MTP.

    Source: Megatron-LM ``training.py`` ``num_floating_point_operations`` and Megatron-Bridge
    ``training/utils/flop_utils.py`` (transformer path, MHA/GQA without a window), as condensed in FORMULAS.md
    §2.2. With h = ``hidden``, n = ``heads``, g = ``query_groups`` (default n), kv = ``kv_channels`` (default
    h/n), q = kv·n, f = 3 if ``glu`` else 2, m = ``mtp_layers``, L' = L + m, T = ``tokens``, Σs² =
    ``sum_seq_squared``::

        F = T·[ 6·h·(f·ffn·L_dense + R·L_moe + f·ffn_sh·L_moe)     # MLP / MoE (router not counted)
              + 6·L'·proj                                          # Q, K, V, [gate], out-proj
              + 6·m·(3h + 2h²)                                     # MTP norms + eh-proj
              + 6·h·V_pad·(m+1) ]                                  # logits, one head per MTP depth too
          + 6·L'·q·Σs²                                             # attention core, causal (already halved)

        proj = h·(q + 2·kv·g + q·gate) + q·h,   R = ffn_moe·topk·f   (latent d: R = ffn_moe·topk·f·d/h + 2d)
        V_pad = ceil(V / (div·TP))·div·TP

    The core is written on Σs² directly (the doc's per-token context c is Σs²/T): for B unpacked sequences of
    length S pass ``tokens=B·S, sum_seq_squared=B·S²``; for packed THD batches pass the Σᵢ sᵢ² of the
    sub-sequences (passing ``pack_length²`` instead is the field's shipped bug). For the linear terms, Bridge
    uses the *padded* token count and Megatron-LM the *real* Σᵢ sᵢ: the caller chooses by what it passes as
    ``tokens``. Per layer and per token the core is 3 (fwd+bwd) · 2 (QKᵀ, PV) · 2 (FMA) · q·s²/2 (causal) =
    6·q·s², so the coefficient of Σs² is 6·L'·q, half of the 12·L·n·d of PaLM/torchtitan.

    Layer types: ``moe_layers`` = L_moe (number of MoE decoder layers; see :func:`moe_layer_pattern`), L_dense =
    ``layers`` − L_moe; the m MTP layers are added to L_moe if ``mtp_moe`` (the last decoder layer is MoE),
    else to L_dense. ``mtp_moe=None`` infers it when unambiguous (no MoE layers → dense; all layers MoE → MoE)
    and raises otherwise. ``moe_ffn_hidden`` falls back to ``ffn_hidden``. The MTP layers also have attention
    (they are counted in L'). Not covered: sliding windows, MLA, GDN/KDA, DSA, the LoRA special case, and the
    vision tower (add :func:`vit_training_flops` yourself; Bridge adds it to the same total).

    Works on ints/Fractions and on sympy expressions alike; only ``vocab`` must be concrete (it is padded)
    unless ``make_vocab_size_divisible_by·tensor_parallel == 1``.
    """
    _no_floats(**{k: v for k, v in locals().items() if not isinstance(v, bool)})
    h, n, L, m = hidden, heads, layers, mtp_layers
    g = n if query_groups is None else query_groups
    kv = _exact_div(h, n) if kv_channels is None else kv_channels
    q = kv * n
    f = 3 if glu else 2
    gate = 1 if attention_output_gate else 0
    layers_with_attention = L + m
    v_pad = padded_vocab(vocab, make_vocab_size_divisible_by, tensor_parallel)

    moe_count = moe_layers
    dense_count = L - moe_layers
    if m != 0:
        if _mtp_is_moe(L, moe_layers, mtp_moe):
            moe_count = moe_count + m
        else:
            dense_count = dense_count + m

    ffn_moe = ffn_hidden if moe_ffn_hidden is None else moe_ffn_hidden
    if moe_latent_size is None:
        routed = ffn_moe * moe_topk * f
    else:
        routed = _exact_div(ffn_moe * moe_topk * f * moe_latent_size, h) + 2 * moe_latent_size

    mlp = 6 * h * (f * ffn_hidden * dense_count + routed * moe_count + f * shared_expert_ffn_hidden * moe_count)
    proj = h * (q + 2 * kv * g + q * gate) + q * h
    attention_linear = 6 * layers_with_attention * proj
    mtp_extra = 6 * m * (3 * h + 2 * h * h)
    logits = 6 * h * v_pad * (m + 1)
    core = 6 * layers_with_attention * q * sum_seq_squared
    return _normalize(tokens * (mlp + attention_linear + mtp_extra + logits) + core)


# --------------------------------------------------------------------------------------------- ViT


def vit_training_flops(
    *,
    sum_patches: Any,
    sum_patches_squared: Any,
    sum_merged_patches: Any,
    depth: Any,
    hidden: Any,
    intermediate: Any,
    spatial_merge_size: Any = 2,
    out_hidden: Any,
    deepstack_layers: Any = 0,
) -> Any:
    """Training FLOPs of a Qwen-VL-style vision tower from exact patch statistics (Bridge only).

    Source: Megatron-Bridge ``flop_utils.py`` ``vit_flops_from_patch_stats`` (used by ``train.py`` whenever
    Σp > 0), FORMULAS.md §2.5. With D = ``depth``, H = ``hidden``, I = ``intermediate``, μ =
    ``spatial_merge_size``, H_out = ``out_hidden`` (Bridge's default is the language model's hidden size) and
    M = 1 + ``deepstack_layers`` (the main merger plus one per ``deepstack_visual_indexes`` entry)::

        ViT = 3·[ D·((8H² + 4H·I)·ΣP + 4H·ΣP²) + M·ΣP_m·(2·(μ²H)² + 2·(μ²H)·H_out) ]

    per block: QKVO 4 GEMMs of H×H (8H² per patch), an ungated MLP (4H·I), a bidirectional core (QKᵀ and PV,
    4H·P² per attention sequence, **not** halved); per merged patch: the merger's two GEMMs (μ²H→μ²H and
    μ²H→H_out). ×3 for forward + backward. Not counted: the patch-embed Conv3d, position embeddings, norms and
    window attention. ΣP, ΣP², ΣP_m come from :func:`vision_patch_stats` (each temporal frame is its own
    attention sequence). Pure polynomial: works with symbols.
    """
    _no_floats(**locals())
    big_h, mu2 = hidden, spatial_merge_size * spatial_merge_size
    blocks = depth * ((8 * big_h * big_h + 4 * big_h * intermediate) * sum_patches + 4 * big_h * sum_patches_squared)
    merged_width = mu2 * big_h
    mergers = (1 + deepstack_layers) * sum_merged_patches * (
        2 * merged_width * merged_width + 2 * merged_width * out_hidden
    )
    return _normalize(3 * (blocks + mergers))


def vision_patch_stats(
    grid_thw_rows: Iterable[Sequence[Any]], spatial_merge_size: int = 2
) -> tuple[int, int, int]:
    """(ΣP, ΣP², ΣP_m) of the ``image_grid_thw`` / ``video_grid_thw`` rows of a batch.

    Source: Megatron-Bridge ``vision_patch_stats_from_grid_thw`` (FORMULAS.md §2.5): for every row (t, h, w),
    ΣP += t·h·w, ΣP² += t·(h·w)² (each of the t frames is an independent attention sequence of h·w patches)
    and ΣP_m += floor(t·h·w / μ²). Concatenate image and video rows (and micro-batches / DP ranks: the stats
    are additive). Rows are concrete integers (lists, tuples, or a tensor's rows).
    """
    mu = _as_int("spatial_merge_size", spatial_merge_size)
    if mu < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {mu}")
    total = total_sq = merged = 0
    for row in grid_thw_rows:
        values = [_as_int("grid_thw", x) for x in row]
        if len(values) != 3 or min(values) < 0:
            raise ValueError(f"grid_thw rows are (t, h, w) of non-negative ints, got {values}")
        t, hh, ww = values
        total += t * hh * ww
        total_sq += t * (hh * ww) ** 2
        merged += (t * hh * ww) // (mu * mu)
    return total, total_sq, merged


def vit_training_flops_legacy(
    *,
    num_vision_patches: int,
    batch: int,
    depth: Any,
    hidden: Any,
    intermediate: Any,
    spatial_merge_size: int = 2,
    out_hidden: Any,
    deepstack_layers: Any = 0,
) -> Any:
    """The legacy ViT estimate, which assumes one equal-sized image per sample (kept to show the bug).

    Source: Megatron-Bridge ``vit_flops(cfg, B, P)`` / ``_compute_vit_flops``, used only when exact patch stats
    are absent (FORMULAS.md §2.5 "Legacy form", and "Bugs the field shipped": patches per image = total / batch
    size). With P̄ = ``num_vision_patches`` / B it feeds :func:`vit_training_flops` with::

        ΣP = B·P̄,   ΣP² = B·P̄²,   ΣP_m = B·floor(P̄ / μ²)

    Exact when every sample holds one image of the same size; with mixed sizes ΣP² is underestimated (by
    convexity, B·P̄² <= Σ Pᵢ²) and ΣP_m can differ by the floors; several images in one sample are treated as
    one long attention sequence. Bridge computes P̄ and the floor in float (``//`` on a float P̄); here P̄ is
    an exact Fraction, which matches whenever the float quotient is exact, and the result may be a Fraction
    (ΣP² = P²/B). ``num_vision_patches``, ``batch`` and ``spatial_merge_size`` must be concrete integers (a floor
    is applied); the model dimensions may be symbols.
    """
    patches = _as_int("num_vision_patches", num_vision_patches)
    b = _as_int("batch", batch)
    mu = _as_int("spatial_merge_size", spatial_merge_size)
    if b < 1:
        raise ValueError(f"batch must be >= 1, got {b}")
    per_sample = Fraction(patches, b)
    sum_patches = _normalize(b * per_sample)
    sum_patches_squared = _normalize(b * per_sample * per_sample)
    sum_merged_patches = b * (per_sample // (mu * mu))  # Fraction // int is the exact floor
    return vit_training_flops(
        sum_patches=sum_patches,
        sum_patches_squared=sum_patches_squared,
        sum_merged_patches=sum_merged_patches,
        depth=depth,
        hidden=hidden,
        intermediate=intermediate,
        spatial_merge_size=mu,
        out_hidden=out_hidden,
        deepstack_layers=deepstack_layers,
    )
