"""Attention masks read from the graph (issue 17, point 3).

A Hugging Face text model called with ``attention_mask`` hands SDPA a mask tensor it built in the
graph from ``arange`` comparisons (causal) and the padding vector. fxflops reads it: under
``causal="half"`` (Megatron) the attention core is halved as for ``is_causal=True``, under
``causal="exact"`` it is the (batch, query, key) triples the mask keeps — counted here by brute force
over the mask, key by key — and the default convention keeps counting the dense work the kernel
does (FlopCounterMode on the eager twin). A sliding window is read too (exact: its kept triples;
half leaves it dense), and so are packed sequences: HF's block-diagonal mask from ``position_ids``
(exact: Σᵢ sᵢ(sᵢ+1)/2 per row, half: Σᵢ sᵢ²/2, both by brute force over HF's definition). A mask
fxflops cannot read stays dense, with a note.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.conventions import FLOPCOUNTER, MEGATRON

transformers = pytest.importorskip("transformers")

EXACT, HALF = FLOPCOUNTER.but(causal="exact"), FLOPCOUNTER.but(causal="half")
HEADS, HEAD_DIM, LAYERS = 4, 8, 2


def kept_triples(mask: torch.Tensor, queries: int, offset: int = 0) -> int:
    """Brute force: (b, q, k) with k <= q + offset and mask[b, k] != 0."""
    batch, keys = mask.shape
    return sum(
        1 for b in range(batch) for q in range(queries) for k in range(keys) if k <= q + offset and mask[b, k] != 0
    )


def attention_core(triples: int) -> int:
    """Forward FLOPs of Q·Kᵀ and P·V over ``triples`` (batch, query, key) triples, every layer:
    2·D each, per query head (FlopCounterMode's sdpa formula, per triple)."""
    return LAYERS * HEADS * 4 * HEAD_DIM * triples


def _text_model(kind: str, attn: str) -> nn.Module:
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    config = config_class(
        vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, attn_implementation=attn,
    )
    torch.manual_seed(0)
    return model_class(config)


def _padded(rng: random.Random, batch: int, seq: int) -> torch.Tensor:
    """A 0/1 mask with padding on the right, on the left, or none, row by row."""
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):
        real = rng.randint(1, seq)
        side = rng.choice(["right", "left", "none"])
        if side == "right":
            mask[b, :real] = 1
        elif side == "left":
            mask[b, seq - real :] = 1
        else:
            mask[b] = 1
    return mask


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.long)])  # the default suite's time
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_causal_mask_with_padding_is_read_from_the_graph(kind, attn):
    """The mask HF builds from ``attention_mask``, handed to SDPA or added to the scores of attention
    written as matrix products (eager: both products are the attention core)."""
    model = _text_model(kind, attn).eval()
    eager = _text_model(kind, "eager").eval()
    eager.load_state_dict(model.state_dict())
    wrapper = fxflops.instrument(model, strict=True)
    rng = random.Random(kind)
    for batch, seq in [(2, 9), (3, 5), (1, 12), (2, 7)]:
        ids, mask = torch.randint(0, 64, (batch, seq)), _padded(rng, batch, seq)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(input_ids=ids, attention_mask=mask)
            with FlopCounterMode(display=False) as reference:
                eager(input_ids=ids, attention_mask=mask)
        dense, kept = attention_core(batch * seq * seq), attention_core(kept_triples(mask, seq))
        full = wrapper.flops.total()
        assert full == reference.get_total_flops()  # the default: the dense work the kernel does
        assert full - wrapper.flops.total(convention=EXACT) == dense - kept
        assert full - wrapper.flops.total(convention=HALF) == dense // 2
        # Megatron (a forward: no backward ran): the attention core halved; causal="exact": the kept triples
        megatron_full = wrapper.flops.total(convention=MEGATRON.but(causal="full"))
        assert megatron_full - wrapper.flops.total(convention=MEGATRON) == dense // 2
        assert megatron_full - wrapper.flops.total(convention=MEGATRON.but(causal="exact")) == dense - kept
    assert wrapper.captures == 1
    assert any("read from the graph as causal and padding from attention_mask" in n for n in wrapper.program.notes)
    assert not any("counted as the dense work" in n for n in wrapper.program.notes)


def test_training_bills_the_kept_triples_in_every_phase():
    """Backward and the recompute inside a fused attention backward scale like the forward."""
    model = _text_model("llama", "sdpa")
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    ids, mask = torch.randint(0, 64, (2, 7)), torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1] * 7])
    wrapper(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    dense, kept = attention_core(2 * 7 * 7), attention_core(kept_triples(mask, 7))
    megatron_full = wrapper.flops.total(convention=MEGATRON.but(causal="full"))  # backward: 2x the forward
    assert megatron_full - wrapper.flops.total(convention=MEGATRON) == 3 * dense // 2
    assert megatron_full - wrapper.flops.total(convention=MEGATRON.but(causal="exact")) == 3 * (dense - kept)
    fwd, bwd, recompute = (wrapper.flops.total(ph) - wrapper.flops.total(ph, convention=EXACT) for ph in ("fwd", "bwd", "recompute"))
    assert fwd == dense - kept
    # FlopCounterMode's sdpa backward: 5/2 the forward's products, a fifth of them the recomputed Q·Kᵀ
    assert bwd + recompute == 5 * fwd // 2 and 5 * recompute == bwd + recompute


def test_the_kept_triples_on_a_device_are_summed_with_tensor_ops():
    """The statistic as an accelerator computes it (tensor ops, no host read) equals the host's."""
    model = _text_model("qwen2", "sdpa").eval()
    wrapper = fxflops.instrument(model, strict=True)
    ids, mask = torch.randint(0, 64, (3, 6)), torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        wrapper(input_ids=ids, attention_mask=mask)
        host = wrapper.flops.total(convention=EXACT)
        wrapper.program.binder.host_metadata = False
        wrapper.flops.reset()
        wrapper(input_ids=ids, attention_mask=mask)
    assert wrapper.flops.total(convention=EXACT) == host
    assert wrapper.flops.total() - host == attention_core(3 * 36) - attention_core(kept_triples(mask, 6))


@pytest.mark.long  # ~9 s (a VLM capture); the text models above cover the reading in the default suite
def test_a_vlm_text_mask_is_read_too():
    from fxflops.models import hf_zoo

    model = hf_zoo.build("qwen2_vl", "sdpa")
    wrapper = fxflops.instrument(model, strict=True)
    text = model.config.get_text_config()
    head_dim = text.hidden_size // text.num_attention_heads
    for seed in (1, 2):
        call = hf_zoo.random_batch("qwen2_vl", random.Random(seed))
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(**call)
        mask = call["attention_mask"]
        batch, seq = mask.shape
        per_triple = text.num_hidden_layers * text.num_attention_heads * 4 * head_dim
        missing = batch * seq * seq - kept_triples(mask, seq)
        assert wrapper.flops.total() - wrapper.flops.total(convention=EXACT) == per_triple * missing


class _Masked(nn.Module):
    """Single-head attention over ``x`` (B, S, D) with a mask it builds from positions."""

    def __init__(self, kind: str, dim: int = 8):
        super().__init__()
        self.kind, self.proj = kind, nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x, padding):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        if self.kind == "top-left":  # half the queries, seeing keys from the start: not aligned at the end
            q = q[:, :, : q.shape[2] // 2]
        queries, keys = q.shape[2], k.shape[2]
        q_pos = torch.arange(queries, device=x.device)[:, None]
        k_pos = torch.arange(keys, device=x.device)[None, :]
        keep = k_pos <= q_pos
        if self.kind == "sliding":  # the last 3 keys, written as HF's sliding_window_overlay does
            keep = keep & (k_pos > q_pos - 3)
        if self.kind == "sliding difference":  # the same window from a difference of two positions
            keep = keep & (q_pos - k_pos < 3)
        if self.kind in ("causal", "sliding", "sliding difference"):
            mask = keep[None, None, :queries] & padding.bool()[:, None, None, :]
        else:
            mask = keep[None, None]
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_plain_model_building_its_own_causal_padding_mask_is_read():
    model = _Masked("causal")
    program = fxflops.trace(model, (torch.randn(2, 6, 8), torch.ones(2, 6, dtype=torch.long)), dims={"x": {0: "b", 1: "s"}, "padding": {0: "b", 1: "s"}})
    wrapper = fxflops.instrument(model, dims={"x": {0: "b", 1: "s"}, "padding": {0: "b", 1: "s"}}, strict=True)
    padding = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    wrapper(torch.randn(3, 7, 8), padding)
    dense = wrapper.flops.total()
    assert dense - wrapper.flops.total(convention=EXACT) == 4 * 8 * (3 * 49 - kept_triples(padding, 7))
    assert "padding_kept_pairs" in {str(s) for s in program.all_symbols}


def window_triples(mask: torch.Tensor, queries: int, window: int) -> int:
    """Brute force: (b, q, k) with q + offset − window < k <= q + offset and mask[b, k] != 0, the
    last query aligned with the last key (offset = keys − queries)."""
    batch, keys = mask.shape
    offset = keys - queries
    return sum(
        1 for b in range(batch) for q in range(queries) for k in range(keys)
        if q + offset - window < k <= q + offset and mask[b, k] != 0
    )


@pytest.mark.parametrize("kind", ["sliding", "sliding difference"])
def test_a_sliding_window_with_padding_is_read_in_a_plain_model(kind):
    """keep = (k <= q) & (k > q − 3) & padding, or (q − k < 3): causal="exact" counts the kept
    triples; "half" (Megatron's s²/2 is for causal masks) leaves the window dense, and the note says so."""
    wrapper = fxflops.instrument(_Masked(kind), dims={"x": {0: "b", 1: "s"}, "padding": {0: "b", 1: "s"}}, strict=True)
    padding = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    wrapper(torch.randn(3, 7, 8), padding)
    per_triple = 4 * 8  # SDPA forward: 4·d per (batch, query, key), one head
    assert wrapper.flops.total() - wrapper.flops.total(convention=EXACT) == per_triple * (3 * 7 * 7 - window_triples(padding, 7, 3))
    assert wrapper.flops.total(convention=HALF) == wrapper.flops.total()
    assert any("sliding window of 3 keys" in n for n in wrapper.program.notes)


@pytest.mark.long  # ~12 s; the plain-model window test stays in the default suite
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_sliding_window_masks_count_the_window(attn):
    """Mistral with a 4-key sliding window, with and without padding (HF builds the window mask from
    positions either way): causal="exact" equals the brute-force count of kept triples; "half" and
    MEGATRON leave the window dense."""
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, sliding_window=4, attn_implementation=attn,
    )
    torch.manual_seed(0)
    wrapper = fxflops.instrument(transformers.MistralForCausalLM(config).eval(), strict=True)
    rng = random.Random(attn)
    for batch, seq, padded in [(2, 9, True), (3, 5, True), (1, 12, False), (2, 7, False)]:
        ids = torch.randint(0, 64, (batch, seq))
        mask = _padded(rng, batch, seq) if padded else torch.ones(batch, seq, dtype=torch.long)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(input_ids=ids, attention_mask=mask if padded else None)
        dense, kept = attention_core(batch * seq * seq), attention_core(window_triples(mask, seq, 4))
        full = wrapper.flops.total()
        assert full - wrapper.flops.total(convention=EXACT) == dense - kept, (batch, seq, padded)
        assert wrapper.flops.total(convention=HALF) == full
        assert wrapper.flops.total(convention=MEGATRON) == wrapper.flops.total(convention=MEGATRON.but(causal="full"))
    assert any("sliding window of 4 keys" in n for n in wrapper.program.notes)


def test_a_mask_fxflops_cannot_read_stays_dense_and_noted():
    """A causal mask whose queries and keys are not aligned at the end is not read: every convention
    counts the dense work, and a note says so."""
    model = _Masked("top-left")
    wrapper = fxflops.instrument(model, dims={"x": {0: "b", 1: "s"}, "padding": {0: "b", 1: "s"}}, strict=True)
    wrapper(torch.randn(2, 8, 8), torch.ones(2, 8, dtype=torch.long))
    assert wrapper.flops.total(convention=EXACT) == wrapper.flops.total(convention=HALF) == wrapper.flops.total()
    assert any("counted as the dense work the kernel does" in n for n in wrapper.program.notes)


def test_a_causal_mask_without_padding_is_a_polynomial():
    model = _Masked("no padding")
    program = fxflops.trace(model, (torch.randn(2, 6, 8), None), dims={"x": {0: "b", 1: "s"}})
    b, s = (sym for sym in sorted(program.symbols, key=str))
    exact = program.formula(convention=EXACT)
    assert not exact.free_symbols - {b, s}
    for batch, seq in [(2, 6), (3, 11), (4, 3)]:  # the trace guards b != 1
        triples = kept_triples(torch.ones(batch, seq), seq)
        dense = program.total(b=batch, s=seq)
        assert dense - program.total(convention=EXACT, b=batch, s=seq) == 4 * 8 * (batch * seq * seq - triples)


class _Broadcast(nn.Module):
    """A causal-looking mask whose padding row is broadcast over the batch (shape (1, S)): each row
    of the batch sees the same padding, so the kept triples are B x those of that row, not a sum
    over the padding tensor's rows; and a query position tensor of size 1 broadcast over queries."""

    def __init__(self, kind: str, dim: int = 8):
        super().__init__()
        self.kind, self.proj = kind, nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x, padding):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        batch, seq = q.shape[0], q.shape[2]
        positions = torch.arange(seq)
        if self.kind == "one query position":  # every query row gets row 0's mask: k <= 0
            keep = positions[None, :] <= torch.arange(1)[:, None]
            mask = keep[None, None]
        else:
            mask = (positions[None, :] <= positions[:, None])[None, None] & padding.bool()[:, None, None, :]
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(batch, 1, seq, seq))


@pytest.mark.parametrize("kind", ["padding row broadcast", "one query position"])
def test_a_mask_that_broadcasts_a_size_one_dim_is_not_misread(kind):
    model = _Broadcast(kind)
    dims = {"x": {0: "b", 1: "s"}, "padding": {1: "s"}}
    wrapper = fxflops.instrument(model, dims=dims, strict=True)
    padding = torch.tensor([[1, 1, 1, 1, 0, 0]])
    wrapper(torch.randn(3, 6, 8), padding)
    missing = wrapper.flops.total() - wrapper.flops.total(convention=EXACT)
    if kind == "padding row broadcast":  # read or not, never the one-row sum: dense, or 3x that row
        assert missing in (0, 4 * 8 * (3 * 36 - 3 * kept_triples(padding, 6)))
    else:  # row 0's mask for every query is not causal: never halved
        assert missing == 0 and wrapper.flops.total(convention=HALF) == wrapper.flops.total()


# ---- packed sequences: HF's block-diagonal mask from position_ids (find_packed_sequence_indices) ----


def packed_triples(positions: torch.Tensor, causal: bool = True, window: int | None = None) -> int:
    """Brute force over HF's packed mask, from its definition: a row's sequence id goes up by one
    wherever a position is not the one before + 1; (b, q, k) is kept when q and k have the same id
    and (causal) pos[b, k] <= pos[b, q] (and, with a window, pos[b, k] > pos[b, q] − window)."""
    total = 0
    for row in positions.tolist():
        ids = [0]
        for before, here in zip(row, row[1:]):
            ids.append(ids[-1] + (here - before != 1))
        for q in range(len(row)):
            for k in range(len(row)):
                same = ids[q] == ids[k]
                ordered = not causal or row[k] <= row[q]
                near = window is None or row[k] > row[q] - window
                total += same and ordered and near
    return total


def _packed_positions(rng: random.Random, batch: int, seq: int) -> torch.Tensor:
    """Each row cut into random sequences, each numbered from 0 (one row may be one sequence)."""
    rows = []
    for _ in range(batch):
        row = []
        while len(row) < seq:
            row += list(range(min(rng.randint(1, seq), seq - len(row))))
        rows.append(row)
    return torch.tensor(rows)


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.long)])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_sequences_are_read_from_position_ids(kind, attn):
    """Without ``attention_mask`` and without a cache, HF masks packed sequences block-diagonally
    from ``position_ids``: causal="exact" counts the kept triples (Σᵢ sᵢ(sᵢ+1)/2 per row), "half"
    and MEGATRON half of each block (Σᵢ sᵢ²/2), the default the dense kernel's work."""
    model = _text_model(kind, attn).eval()
    eager = _text_model(kind, "eager").eval()
    eager.load_state_dict(model.state_dict())
    wrapper = fxflops.instrument(model, strict=True)
    rng = random.Random(kind)
    for batch, seq in [(2, 9), (3, 5), (1, 12), (2, 7), (2, 6)]:
        ids, positions = torch.randint(0, 64, (batch, seq)), _packed_positions(rng, batch, seq)
        if seq == 6:
            positions = torch.arange(seq).repeat(batch, 1)  # one sequence per row: HF skips the mask
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(input_ids=ids, position_ids=positions, use_cache=False)
            with FlopCounterMode(display=False) as reference:
                eager(input_ids=ids, position_ids=positions, use_cache=False)
        dense = attention_core(batch * seq * seq)
        kept, blocks = attention_core(packed_triples(positions)), attention_core(packed_triples(positions, causal=False))
        full = wrapper.flops.total()
        assert full == reference.get_total_flops()
        assert full - wrapper.flops.total(convention=EXACT) == dense - kept, positions
        assert full - wrapper.flops.total(convention=HALF) == dense - blocks // 2
        megatron_full = wrapper.flops.total(convention=MEGATRON.but(causal="full"))
        assert megatron_full - wrapper.flops.total(convention=MEGATRON) == dense - blocks // 2
        assert megatron_full - wrapper.flops.total(convention=MEGATRON.but(causal="exact")) == dense - kept
    assert wrapper.captures == 1
    assert any("inside the runs of consecutive position_ids (packed sequences)" in n for n in wrapper.program.notes)
    assert "position_ids_kept_pairs" in {str(s) for s in wrapper.program.all_symbols}


def test_packed_training_bills_the_blocks_in_every_phase_and_on_a_device():
    """Backward and the fused backward's recompute scale like the forward; the statistic computed
    with tensor ops (as on an accelerator) equals the host's."""
    model = _text_model("llama", "sdpa")
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    ids, positions = torch.randint(0, 64, (2, 8)), torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 0, 1, 2, 3]])
    wrapper(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
    dense, kept = attention_core(2 * 64), attention_core(packed_triples(positions))
    fwd, bwd, recompute = (wrapper.flops.total(ph) - wrapper.flops.total(ph, convention=EXACT) for ph in ("fwd", "bwd", "recompute"))
    assert fwd == dense - kept and bwd + recompute == 5 * fwd // 2
    host = wrapper.flops.total(convention=EXACT)
    wrapper.program.binder.host_metadata = False
    wrapper.flops.reset()
    wrapper(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
    assert wrapper.flops.total(convention=EXACT) == host


class _Packed(nn.Module):
    """Single-head attention over packed rows, the sequence ids built from ``positions`` as HF's
    ``find_packed_sequence_indices`` does (``ids``) or from the first token of each sequence
    (``zeros``: not read, a position 0 does not prove the next ones step by 1); ``causal`` adds
    HF's remapped causal rule pos[k] <= pos[q]. ``positions`` may be one row for the whole batch."""

    def __init__(self, ids: str, causal: bool, dim: int = 8):
        super().__init__()
        self.ids, self.causal, self.proj = ids, causal, nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x, positions):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        batch, seq = x.shape[:2]
        positions = positions.expand(batch, -1)
        if self.ids == "ids":
            runs = (torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
        else:
            runs = (positions == 0).cumsum(-1)
        b = torch.arange(batch)[:, None, None, None]
        q_at, k_at = torch.arange(seq)[None, None, :, None], torch.arange(seq)[None, None, None, :]
        keep = runs[b, q_at] == runs[b, k_at]
        if self.causal:
            keep = keep & (positions[b, k_at] <= positions[b, q_at])
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rows", ["per row", "one row"])
def test_a_plain_model_packing_its_own_sequences_is_read(causal, rows):
    """Bidirectional packing (only "same sequence") counts whole blocks, Σᵢ sᵢ², under "exact" and
    "half"; causal packing Σᵢ sᵢ(sᵢ+1)/2 and Σᵢ sᵢ²/2. A positions row broadcast over the batch counts
    for every row."""
    dims = {"x": {0: "b", 1: "s"}, "positions": {1: "s"} if rows == "one row" else {0: "b", 1: "s"}}
    wrapper = fxflops.instrument(_Packed("ids", causal), dims=dims, strict=True)
    rng = random.Random(rows)
    for seq in (7, 10, 4, 9):
        positions = _packed_positions(rng, 1 if rows == "one row" else 3, seq)
        if seq == 9:  # any integers: repeats, steps back, gaps (HF's definition holds for every row)
            positions = torch.randint(-3, 4, positions.shape)
        wrapper.flops.reset()
        wrapper(torch.randn(3, seq, 8), positions)
        expanded = positions.expand(3, -1)
        dense, per_triple = wrapper.flops.total(), 4 * 8
        kept, blocks = packed_triples(expanded, causal), packed_triples(expanded, causal=False)
        assert dense - wrapper.flops.total(convention=EXACT) == per_triple * (3 * seq * seq - kept)
        assert dense - wrapper.flops.total(convention=HALF) == per_triple * 3 * seq * seq - per_triple * blocks // (2 if causal else 1)
    assert wrapper.captures == 1


def test_sequence_ids_that_do_not_prove_consecutive_positions_stay_dense():
    """Ids from ``positions == 0`` leave the steps inside a sequence unknown: not read, noted."""
    wrapper = fxflops.instrument(_Packed("zeros", True), dims={"x": {0: "b", 1: "s"}, "positions": {0: "b", 1: "s"}}, strict=True)
    wrapper(torch.randn(2, 6, 8), torch.tensor([[0, 1, 2, 0, 1, 2], [0, 2, 4, 6, 0, 3]]))
    assert wrapper.flops.total(convention=EXACT) == wrapper.flops.total(convention=HALF) == wrapper.flops.total()
    assert any("counted as the dense work the kernel does" in n for n in wrapper.program.notes)


@pytest.mark.long  # ~8 s; the plain-model packing tests cover windows' absence in the default suite
def test_hf_packed_sequences_with_a_sliding_window():
    """Mistral's 4-key window inside packed sequences: "exact" counts min(place in the sequence, 4)
    per query; "half" counts the blocks whole (a window is not halved)."""
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, sliding_window=4, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    wrapper = fxflops.instrument(transformers.MistralForCausalLM(config).eval(), strict=True)
    rng = random.Random(4)
    for batch, seq in [(2, 11), (3, 6), (1, 9)]:
        ids, positions = torch.randint(0, 64, (batch, seq)), _packed_positions(rng, batch, seq)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(input_ids=ids, position_ids=positions, use_cache=False)
        dense = attention_core(batch * seq * seq)
        kept, blocks = attention_core(packed_triples(positions, window=4)), attention_core(packed_triples(positions, causal=False))
        assert wrapper.flops.total() - wrapper.flops.total(convention=EXACT) == dense - kept
        assert wrapper.flops.total() - wrapper.flops.total(convention=HALF) == dense - blocks


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.long)])
def test_generation_counts_the_kept_triples_of_every_decode_step(attn):
    """A padded batch generating: the prefill keeps k <= q over the real tokens; each decode step's
    one query row (which SDPA may share between the query heads of a key-value head) keeps every
    real key of the cache: Σ_b (real tokens of row b so far), by brute force over the mask."""
    model = _text_model("llama", attn).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 63
    wrapper = fxflops.instrument(model, strict=True)
    ids, mask = torch.randint(1, 60, (2, 6)), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    new = 4
    wrapper.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    decode_dense = sum(attention_core(2 * (6 + step)) for step in range(1, new))
    decode_kept = sum(
        attention_core(kept_triples(torch.cat([mask, torch.ones(2, step, dtype=torch.long)], 1), 1, offset=5 + step))
        for step in range(1, new)
    )
    assert wrapper.flops.total("prefill") - wrapper.flops.total("prefill", convention=EXACT) == attention_core(2 * 36) - attention_core(kept_triples(mask, 6))
    assert wrapper.flops.total("decode") - wrapper.flops.total("decode", convention=EXACT) == decode_dense - decode_kept


def test_an_eager_attention_mask_that_is_not_read_is_said():
    """Without ``attention_mask``, ``position_ids`` and a cache, transformers builds the mask from the
    runs of positions it makes itself (``find_packed_sequence_indices`` of an ``arange``), which the
    mask reader does not follow: counted dense under every convention, causal ones too, and now
    said in the notes (was: no note). With positions given, the same mask is read as causal."""
    model = _text_model("llama", "eager").eval()
    ids = torch.randint(1, 64, (1, 7))
    with torch.no_grad():
        unread = fxflops.trace(model, (), {"input_ids": ids, "use_cache": False})
        read = fxflops.trace(model, (), {"input_ids": ids, "use_cache": False, "position_ids": torch.arange(7)[None]})
    assert any("mask that is not read" in note for note in unread.notes)
    assert not any("mask that is not read" in note for note in read.notes)
    assert any("read from the graph as causal" in note for note in read.notes)
