"""Training FLOPs: forward + backward (+ recompute) from the traced autograd graph.

References: FlopCounterMode on a real forward + ``loss.backward()`` (CPU flash attention counted with
torch's own SDPA formulas, grouped convolutions as per-group convolutions, see ``reference.py``);
per module, every module call replayed alone under FlopCounterMode (its own per-module backward
attribution is a heuristic that lets sibling modules absorb each other's backward).
"""

from __future__ import annotations

import functools
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from torch import nn
from torch.utils import flop_counter
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fxflops
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT
from reference import flop_counter_with_cpu_attention, model_training_reference_total, per_module_training_reference, training_reference_total
from zoo import CASES

DRAWS_PER_MODEL = 10  # 5 models -> 50 random shapes (the long suite: 25 each)


def train_step(wrapper, inputs) -> dict[str, int]:
    wrapper.flops.reset()
    out = wrapper(*inputs)
    sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()).backward()
    return wrapper.flops.breakdown()


@pytest.mark.parametrize("draws", [DRAWS_PER_MODEL, pytest.param(25, marks=pytest.mark.long)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_backward_flops_equal_flopcountermode(case, draws):
    torch.manual_seed(0)
    model = case.factory()
    wrapper = fxflops.instrument(model, dims=case.dims, backward=True, on_miss="raise", strict=True)

    @settings(max_examples=draws, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case.shapes)
    def check(shapes):
        inputs = case.make(shapes)
        got = train_step(wrapper, inputs)
        expected = per_module_training_reference(model, *inputs)
        for path, flops in expected.items():
            assert got[path] == flops, (shapes, path)

    check()
    assert wrapper.captures == 1
    assert not wrapper.program.unsupported


def test_phases_split_the_total():
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=2))
    ids = torch.randint(0, 100, (2, 9))
    program = fxflops.trace(model, (ids,), dims={"input_ids": {0: "b", 1: "s"}}, backward=True)
    values = {"b": 3, "s": 17}
    fwd, bwd = program.total(phase="fwd", **values), program.total(phase="bwd", **values)
    recompute = program.total(phase="recompute", **values)
    batch = torch.randint(0, 100, (3, 17))
    # the fused SDPA backward recomputes Q·Kᵀ: one (b·heads, s, d) x (b·heads, d, s) bmm per layer
    assert recompute == 2 * flop_counter.bmm_flop((3 * 2, 17, 16), (3 * 2, 16, 17))
    assert fwd + bwd == model_training_reference_total(model, batch)  # attention backward as bmm's
    assert fwd + bwd + recompute == program.total(**values) == training_reference_total(model, batch)
    forward_only = fxflops.trace(model, (ids,), dims={"input_ids": {0: "b", 1: "s"}})
    assert forward_only.total(**values) == fwd
    assert "backward traced from the autograd graph" in program.table(**values)


def test_two_x_rule_is_available_and_named():
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=1))
    ids = torch.randint(0, 100, (2, 9))
    program = fxflops.trace(model, (ids,), dims={"input_ids": {0: "b", 1: "s"}}, backward="2x")
    assert program.total(phase="bwd", b=2, s=9) == 2 * program.total(phase="fwd", b=2, s=9)
    assert "backward = 2x forward" in program.table(b=2, s=9)


def test_forward_under_no_grad_counts_forward_only():
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=1))
    wrapper = fxflops.instrument(model, backward=True)
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        wrapper(ids)
    assert wrapper.flops.total(phase="bwd") == 0
    assert wrapper.flops.total() == wrapper.program.total(phase="fwd", input_ids_0=2, input_ids_1=9)
    assert wrapper.program.backward == "none"  # grad mode is part of the situation: a forward program
    wrapper(ids).sum().backward()
    training = wrapper.programs[-1]
    assert wrapper.captures == 2 and training.backward == "traced"
    assert wrapper.flops.total(phase="bwd") == training.total(phase="bwd", input_ids_0=2, input_ids_1=9) > 0
    assert training.total(phase="fwd", input_ids_0=2, input_ids_1=9) == wrapper.program.total(input_ids_0=2, input_ids_1=9)


def _flop_counter(run) -> int:
    with flop_counter_with_cpu_attention(), flop_counter.FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def test_the_backward_is_counted_when_it_runs_and_each_time():
    """A call in grad mode adds its forward; its backward is added when a backward reaches its
    outputs: not at all for an evaluation left in grad mode, twice for two passes over a retained
    graph, once per call for microbatches whose losses are summed into one backward."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=2))
    wrapper = fxflops.instrument(model, backward=True)
    ids = [torch.randint(0, 100, (2, n)) for n in (9, 5)]
    wrapper(ids[0]).sum().backward()  # captured

    def twice(f):
        out = f(ids[0]).sum()
        out.backward(retain_graph=True)
        out.backward()

    cases = {
        "no backward follows": lambda f: f(ids[0]),
        "two backwards of one graph": twice,
        "two microbatches, one backward": lambda f: (f(ids[0]).sum() + f(ids[1]).sum()).backward(),
        "a backward from part of the output": lambda f: f(ids[1])[:, :3].sum().backward(),
    }
    for label, run in cases.items():
        wrapper.flops.reset()
        run(wrapper)
        assert wrapper.flops.uncounted == 0, label
        assert wrapper.flops.total() == _flop_counter(lambda: run(model)), label


class _TwoHeads(nn.Module):
    """A trunk and two heads; with ``loss``, a loss from the first head and the second's output,
    which the loss does not read (LLaVA's vision hidden state)."""

    def __init__(self, loss: bool = False) -> None:
        super().__init__()
        self.loss = loss
        self.trunk, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.trunk(x)
        a, b = self.a(h), self.b(h)
        return {"loss": a.square().mean(), "side": b} if self.loss else (a, b)


def test_a_backward_from_the_loss_is_whole_where_another_output_is_not_differentiated():
    """The traced backward of an output with a loss starts from the loss: ``out["loss"].backward()``
    is the whole of it although ``side`` gets no gradient; a backward from ``side`` alone is not."""
    torch.manual_seed(0)
    model = _TwoHeads(loss=True)
    wrapper = fxflops.instrument(model, backward=True)
    x = torch.randn(4, 8)
    wrapper(x)["loss"].backward()
    wrapper.flops.reset()
    wrapper(x)["loss"].backward()
    assert wrapper.flops.uncounted == 0
    assert wrapper.flops.total() == _flop_counter(lambda: model(x)["loss"].backward())
    wrapper.flops.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapper(x)["side"].sum().backward()
    assert wrapper.flops.uncounted == 1


def test_a_backward_through_part_of_the_call_s_graph_is_not_counted_and_said():
    """A backward from one of two outputs, to some leaves only (``backward(inputs=...)``) or by
    ``torch.autograd.grad`` runs less than the traced backward (was billed whole: 8192 and 12288
    vs FlopCounterMode's 6144 and 8192): its forward is counted, its backward not, with a warning;
    a backward through every output stays exact."""
    torch.manual_seed(0)
    model = _TwoHeads()
    x = torch.randn(4, 8, requires_grad=True)
    partial = {
        "one of two outputs": lambda f: f(x)[0].sum().backward(),
        "backward(inputs=...)": lambda f: sum(o.sum() for o in f(x)).backward(inputs=[x]),
        "torch.autograd.grad": lambda f: torch.autograd.grad(sum(o.sum() for o in f(x)), [x]),
    }
    with torch.no_grad():
        forward = _flop_counter(lambda: model(x))
    for label, run in partial.items():
        wrapper = fxflops.instrument(model, backward=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(wrapper)
        assert wrapper.flops.uncounted == 1 and wrapper.flops.total() == forward, label
        assert any("only part of the traced backward" in str(w.message) for w in caught), label

    def whole(f):  # noqa: ANN001, ANN202 - every output of the call
        a, b = f(x)
        (a * b).sum().backward()

    wrapper.flops.reset()
    whole(wrapper)
    assert wrapper.flops.uncounted == 0 and wrapper.flops.total() == _flop_counter(lambda: whole(model))


def test_a_backward_that_records_the_gradients_graph_is_not_counted_and_said():
    """``backward(create_graph=True)`` and a later pass through the gradients (a gradient penalty,
    MAML's outer step): the second pass runs double-backward work the traced backward does not have
    (was: billed as the traced backward, 4096 vs FlopCounterMode's 6656, nothing said). The forward
    is counted; the backward passes are not, each said; a plain training call after them is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    wrapper = fxflops.instrument(model, backward=True)
    x = torch.randn(4, 8)

    def penalized(f):  # noqa: ANN001, ANN202
        f(x).square().sum().backward(create_graph=True)
        sum(p.grad.square().sum() for p in model.parameters()).backward()
        model.zero_grad(set_to_none=True)

    def plain(f):  # noqa: ANN001, ANN202
        f(x).square().sum().backward()

    plain(wrapper)  # the capture
    with torch.no_grad():
        forward = _flop_counter(lambda: model(x))
    wrapper.flops.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        penalized(wrapper)
    assert wrapper.flops.total() == forward < _flop_counter(lambda: penalized(model))
    assert wrapper.flops.uncounted == 2  # the pass recording the graph, the one through it
    assert any("create_graph=True" in str(w.message) for w in caught)
    wrapper.flops.reset()
    plain(wrapper)
    assert wrapper.flops.uncounted == 0 and wrapper.flops.total() == _flop_counter(lambda: plain(model))


class _LossAndLogits(nn.Module):
    """A loss computed from the logits it also returns, as a Hugging Face model with ``labels`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(10, 8), nn.Linear(8, 64), nn.Linear(64, 3)
        self.activations: list[weakref.ref] = []

    def forward(self, ids):
        h = torch.relu(self.hidden(self.embed(ids)))
        self.activations.append(weakref.ref(h))  # saved by the head's backward
        logits = self.head(h)
        return {"loss": logits.square().mean(), "logits": logits}


@pytest.mark.parametrize("then", ["no backward", "a backward"])
def test_a_counted_call_keeps_no_autograd_graph_alive(then):
    """Counting a training call holds none of its autograd graph: an evaluation left in grad mode
    frees each call's activations (was: every call's graph kept, its saved activations too, when one
    output is computed from another), and a parameter resized after a backward (transformers'
    ``resize_token_embeddings``) trains on (was: every later backward raised, the old gradient
    accumulator kept alive with the old shape)."""
    model = _LossAndLogits()
    wrapper = fxflops.instrument(model, backward=True)
    for _ in range(3):
        out = wrapper(torch.randint(0, 10, (4, 5)))
        if then == "a backward":
            out["loss"].backward()
        del out
    gc.collect()
    assert not any(ref() is not None for ref in model.activations)
    model.zero_grad(set_to_none=True)
    model.embed.weight.data = torch.cat([model.embed.weight.data, torch.randn(10, 8)])
    model.embed.num_embeddings = 20
    ids = torch.randint(0, 20, (4, 5))
    wrapper.flops.reset()
    wrapper(ids)["loss"].backward()
    assert wrapper.flops.uncounted == 0
    assert wrapper.flops.total() == _flop_counter(lambda: model(ids)["loss"].backward())


def test_partially_frozen_model_counts_only_the_gradients_autograd_computes():
    """Layer 0 frozen: no weight gradients there, but input gradients (the embedding below trains);
    layer 1 and the head train fully. Reference: every module replayed alone with the same
    requires_grad on its parameters and inputs."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=2))
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    ids = torch.randint(0, 100, (2, 11))
    wrapper = fxflops.instrument(model, backward=True)
    got = train_step(wrapper, (ids,))
    expected = per_module_training_reference(model, ids)
    for path, flops in expected.items():
        assert got[path] == flops, path
    frozen_q = wrapper.program.formula("layers.0.attn.q_proj", phase="bwd")
    trained_q = wrapper.program.formula("layers.1.attn.q_proj", phase="bwd")
    assert 2 * frozen_q == trained_q  # input gradient only vs input + weight gradient


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _save_matmuls(ctx, op, *args, **kwargs):
    """Selective checkpointing policy: keep matmul outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """Four blocks: plain, non-reentrant checkpoint, reentrant checkpoint, selective checkpoint."""

    def __init__(self, width: int = 24, use_checkpoint: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        x = self.blocks[0](x)
        if not self.use_checkpoint:
            return self.blocks[3](self.blocks[2](self.blocks[1](x)))
        x = checkpoint(self.blocks[1], x, use_reentrant=False)
        x = checkpoint(self.blocks[2], x, use_reentrant=True)
        context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        return checkpoint(self.blocks[3], x, use_reentrant=False, context_fn=context)


@pytest.mark.parametrize("rows", [5, 13, 40])
def test_checkpointing_adds_recompute_and_leaves_model_flops_unchanged(rows):
    torch.manual_seed(0)
    model = Checkpointed()
    plain = Checkpointed(use_checkpoint=False)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(rows, 24, requires_grad=True)
    wrapper = fxflops.instrument(model, dims={"x": {0: "rows"}}, backward=True)
    wrapper.flops.reset()
    train_step(wrapper, (x,))
    hardware = training_reference_total(model, x)  # FlopCounterMode sees the recomputation too
    model_flops = training_reference_total(plain, x)
    meter = wrapper.flops
    assert meter.total() == meter.hardware_flops() == hardware
    assert meter.total(phase="fwd") + meter.total(phase="bwd") == meter.model_flops() == model_flops
    assert meter.total(phase="recompute") == hardware - model_flops > 0
    recompute = meter.breakdown(phase="recompute")
    assert recompute["blocks.0"] == 0
    assert recompute["blocks.1"] > 0 and recompute["blocks.2"] > 0
    assert recompute["blocks.3"] == 0  # selective checkpointing saved the matmuls: none recomputed


@pytest.mark.parametrize("draws", [5, pytest.param(12, marks=pytest.mark.long)])
def test_example_vlm_forward_backward_equals_flopcountermode(draws):
    """The packed VLM with fxflops' varlen op, fwd+bwd from one capture, against FlopCounterMode on
    the same batches run with SDPA per segment (the kernel the varlen op runs, CPU attention counted
    with torch's formulas), total and per top-level module (each module replayed alone)."""
    import random
    from dataclasses import replace

    from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch

    cfg = VLMConfig(vision_layers=1, layers=1)
    torch.manual_seed(0)
    model = TinyVLM(cfg)
    reference = TinyVLM(replace(cfg, attention="loop_sdpa"))
    reference.load_state_dict(model.state_dict())
    wrapper = fxflops.instrument(
        model, dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}}, backward=True, on_miss="raise", strict=True
    )
    rng = random.Random(0)
    for draw in range(draws):
        batch = random_batch(cfg, rng, images=(1, 5), sequences=(1, 12), padding=rng.choice([0, 4]))
        got = train_step(wrapper, batch.inputs())
        expected = per_module_training_reference(reference, *batch.inputs())
        for path in ("", "visual", "language_model", "lm_head", "visual.blocks.0.attn"):
            assert got[path] == expected[path], (draw, path)
    assert wrapper.captures == 1


def test_frozen_vision_tower():
    """Patch embedding, vision blocks and the merger's norm frozen, the merger's MLP trained: the
    blocks need no gradient at all (nothing below them trains); the MLP's first layer needs only its
    weight gradient, its second layer also the input gradient (to reach the first); the language
    model everything.
    Reference: every module replayed alone with the same requires_grad (SDPA per segment)."""
    import random
    from dataclasses import replace

    from fxflops.models.tiny_vlm import TinyVLM, VLMConfig, random_batch

    cfg = VLMConfig(vision_layers=1, layers=1)
    torch.manual_seed(0)
    model = TinyVLM(cfg)
    reference = TinyVLM(replace(cfg, attention="loop_sdpa"))
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        for p in [*m.visual.patch_embed.parameters(), *m.visual.blocks.parameters(), *m.visual.merger.norm.parameters()]:
            p.requires_grad_(False)
    wrapper = fxflops.instrument(model, dims={"input_ids": {1: "tokens"}, "pixel_values": {0: "patches"}}, backward=True)
    batch = random_batch(cfg, random.Random(1), images=(2, 4))
    got = train_step(wrapper, batch.inputs())
    expected = per_module_training_reference(reference, *batch.inputs())
    for path in ("", "visual", "visual.blocks.0", "visual.merger", "language_model", "lm_head"):
        assert got[path] == expected[path], path
    program = wrapper.program
    assert program.formula("visual.blocks", phase="bwd") == 0
    assert program.formula("visual.patch_embed", phase="bwd") == 0
    first, second = "visual.merger.mlp.0", "visual.merger.mlp.2"
    assert program.formula(first, phase="bwd") == program.formula(first, phase="fwd")  # weight gradient only
    assert program.formula(second, phase="bwd") == 2 * program.formula(second, phase="fwd")  # weight and input


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


class SelectivelyCheckpointed(nn.Module):
    """A block under selective checkpointing whose policy is an attribute; another one plainly checkpointed."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.policy = _save_matmuls

    def forward(self, x):
        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        x = checkpoint(self.blocks[0], x, use_reentrant=False, context_fn=context)
        return checkpoint(self.blocks[1], x, use_reentrant=False)


def test_selective_checkpointing_recomputes_what_its_policy_says_and_a_new_policy_is_another_situation():
    """Recompute everything, save everything, save only matmuls, then the first again: each call
    equals FlopCounterMode (which sees the recompute the policy leaves), the matmuls' recompute
    present only where the policy recomputes them (was none at all: the capture's proxy mode made
    selective checkpointing save every output)."""
    torch.manual_seed(0)
    model = SelectivelyCheckpointed()
    wrapper = fxflops.instrument(model, backward=True)
    x = torch.randn(7, 24, requires_grad=True)
    up = 2 * 7 * 24 * 48  # 2·rows·in·out; down's output no backward needs: early stop skips it
    for policy, recomputed in ((_recompute_all, up), (_save_all, 0), (_save_matmuls, 0), (_recompute_all, up)):
        model.policy = policy
        wrapper.flops.reset()
        train_step(wrapper, (x,))
        assert wrapper.flops.total() == training_reference_total(model, x), policy.__name__
        assert wrapper.flops.breakdown(phase="recompute")["blocks.0"] == recomputed, policy.__name__
    assert wrapper.captures == 3


@pytest.mark.parametrize("early_stop", [False, True])
def test_checkpointing_early_stop_set_around_a_call_is_another_situation(early_stop):
    """``set_checkpoint_early_stop(False)`` makes a non-reentrant checkpoint recompute its whole region
    (here the last matmul too, whose output the backward does not need): a call under it and one
    without are each counted as FlopCounterMode counts them under the same setting, in either order."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    torch.manual_seed(0)
    model = Checkpointed()
    wrapper = fxflops.instrument(model, backward=True)
    x = torch.randn(5, 24, requires_grad=True)
    totals = {}
    for setting in (early_stop, not early_stop, early_stop):
        with set_checkpoint_early_stop(setting):
            wrapper.flops.reset()
            train_step(wrapper, (x,))
            assert wrapper.flops.total() == training_reference_total(model, x), setting
            totals[setting] = wrapper.flops.total()
    assert totals[False] > totals[True]


@pytest.mark.parametrize("how", ["reentrant", "no early stop", "early stop"])
def test_checkpoint_around_the_instrumented_model_bills_its_recompute_as_recompute(how):
    """``checkpoint(wrapper, x)``: the forward torch re-runs in the backward is the ``recompute``
    phase (hardware FLOPs, not model FLOPs; was counted as a second forward: MFU too high). A
    non-reentrant recompute that torch stops early (its default) ran an unknown part of the forward:
    that call is uncounted and warned, never billed whole or as 0 in silence."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    torch.manual_seed(0)
    model = Checkpointed(use_checkpoint=False)
    wrapper = fxflops.instrument(model, backward=True)
    x = torch.randn(6, 24, requires_grad=True)

    def step(module) -> None:  # noqa: ANN001
        with set_checkpoint_early_stop(how == "early stop"):
            checkpoint(module, x, use_reentrant=how == "reentrant").sum().backward()

    with flop_counter_with_cpu_attention(), flop_counter.FlopCounterMode(display=False) as counter:
        step(model)
    hardware, model_flops = counter.get_total_flops(), training_reference_total(model, x)
    meter = wrapper.flops
    for again in (False, True):
        meter.reset()
        if how == "early stop":
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                step(wrapper)
            assert again or any("stopped its recompute early" in str(w.message) for w in said)  # warned once per wrapper
            assert meter.uncounted == 1 and meter.total("recompute") == 0
            assert meter.total() == model_flops  # the call itself, forward and backward, exact
            continue
        step(wrapper)
        assert (meter.total(), meter.model_flops(), meter.uncounted) == (hardware, model_flops, 0)
        assert meter.total("recompute") == hardware - model_flops > 0
        assert meter.calls == 1
