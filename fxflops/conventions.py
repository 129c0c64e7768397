"""Conventions: what a FLOPs number counts. Every table and report names the one it used.

A :class:`Convention` is applied when a Program is evaluated (the capture is the same):

* ``count``: ``"matmul"`` counts matrix products and attention only (the MFU convention of
  FlopCounterMode, Megatron, PaLM, torchtitan); ``"all"`` also elementwise ops, norms, softmax and
  reductions with the documented per-op costs of ``fxflops/rules/elementwise.py``.
* ``causal``: ``"full"`` counts causal attention as dense (FlopCounterMode, PaLM, torchtitan);
  ``"half"`` as s²/2 (Megatron); ``"exact"`` as the s(s+1)/2 query-key pairs the mask keeps. The op
  must say it is causal (``is_causal=True``, varlen ``causal=True``) or be given a causal mask built
  in the graph from positions, with or without padding (``analysis/masks.py``: what an HF model
  builds from ``attention_mask``; ``exact`` then counts the triples it keeps); masks it cannot read
  (any other mask tensor, a flex block mask) are counted dense and reported in ``program.notes``.
* ``embeddings``: count embedding gathers (one FLOP per gathered element) or not.
* ``backward``: ``"traced"`` (the backward graph autograd really runs; needs ``backward=True`` at
  capture) or ``"2x"`` (twice the forward, as formula-based tools assume).
* ``recompute``: include activation-checkpointing recompute (hardware FLOPs, HFU) or not (MFU).
* ``router``: count mixture-of-experts router GEMMs (the matmuls whose scores feed a top-k expert
  choice; FlopCounterMode, torchtitan) or not (Megatron).
* ``moe``: routed experts as ``"model"`` (top_k × tokens × expert cost, from the traced dropless
  dispatch: what MFU formulas assume) or ``"actual"`` (each expert module's matrix products measured
  on the rows the real dispatch computed: capacity drops, padding, uneven experts; needs
  ``instrument(..., measure_routing=True)``).
* ``unit``: ``"flops"`` (a multiply-add is 2) or ``"macs"`` (a multiply-add is 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

_CHOICES = {
    "count": ("matmul", "all"),
    "causal": ("full", "half", "exact"),
    "backward": ("traced", "2x"),
    "unit": ("flops", "macs"),
    "moe": ("model", "actual"),
}


@dataclass(frozen=True)
class Convention:
    """What counts; see the module docstring. Presets: FLOPCOUNTER, MEGATRON, PALM, TORCHTITAN."""

    name: str = "custom"
    count: str = "matmul"
    causal: str = "full"
    embeddings: bool = False
    backward: str = "traced"
    recompute: bool = True
    unit: str = "flops"
    router: bool = True
    moe: str = "model"

    def __post_init__(self) -> None:
        for field, choices in _CHOICES.items():
            if getattr(self, field) not in choices:
                raise ValueError(f"Convention.{field} must be one of {choices}, not {getattr(self, field)!r}")

    def but(self, **changes: object) -> Convention:
        """This convention with some fields changed (named ``<name>+``)."""
        return replace(self, name=f"{self.name}+" if "name" not in changes else changes.pop("name"), **changes)

    def describe(self) -> str:
        """One line naming every choice, printed with every number."""
        parts = [
            "matmul-family only" if self.count == "matmul" else "all ops (elementwise at documented costs)",
            {"full": "causal attention not halved", "half": "causal attention halved (s²/2)", "exact": "causal attention s(s+1)/2"}[self.causal],
            "embedding gathers counted" if self.embeddings else "embeddings not counted",
            "backward traced from the autograd graph" if self.backward == "traced" else "backward = 2x forward",
            "recompute included (HFU)" if self.recompute else "recompute excluded (MFU)",
            "MoE router GEMMs counted" if self.router else "MoE router GEMMs not counted",
            "routed experts at top_k x tokens (model)" if self.moe == "model" else "routed experts as dispatched (actual)",
            "FLOPs (multiply-add = 2)" if self.unit == "flops" else "MACs (multiply-add = 1)",
        ]
        return f"{self.name}: " + ", ".join(parts)


FLOPCOUNTER = Convention("flopcounter")
"""torch.utils.flop_counter.FlopCounterMode's numbers (the default): matmul-family, causal not halved,
backward as traced (fused attention backward 2.5x its forward), recompute included."""

MEGATRON = Convention("megatron", causal="half", backward="2x", recompute=False, router=False)
"""Megatron-LM / Megatron-Bridge ``num_floating_point_operations``: every GEMM x3 (fwd, dgrad,
wgrad), attention core QKᵀ and PV with causal s²/2, no recompute, embeddings and MoE router GEMMs
not counted (routed experts at top-k, shared experts counted)."""

PALM = Convention("palm", backward="2x", recompute=False)
"""PaLM Appendix B / nanoGPT ``estimate_mfu``: 6N per token + 12·L·H·Q·T, causal not halved."""

TORCHTITAN = Convention("torchtitan", backward="2x", recompute=False)
"""torchtitan ``get_dense_model_nparams_and_flops``: 6N + 12·L·n·d·T, no causal halving."""

PRESETS = {c.name: c for c in (FLOPCOUNTER, MEGATRON, PALM, TORCHTITAN)}


def as_convention(convention: Convention | str | None) -> Convention | None:
    """``convention``, a preset given by its name (``"megatron"``), or None; ValueError naming the
    presets for another name or value."""
    if convention is None or isinstance(convention, Convention):
        return convention
    if isinstance(convention, str) and convention in PRESETS:
        return PRESETS[convention]
    raise ValueError(f"convention must be a Convention or one of {sorted(PRESETS)}, not {convention!r}")
