"""The torch.compile backend: counts every graph Dynamo compiles, as instrument() counts the model."""

from __future__ import annotations

import random

import torch

import fxflops
from fxflops.models.tiny_gpt import Block, GPTConfig, TinyGPT

CFG = GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=2)


class BrokenBlock(Block):
    """A decoder block with a graph break between attention and MLP."""

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        torch._dynamo.graph_break()
        return x + self.mlp(self.mlp_norm(x))


class BrokenGPT(TinyGPT):
    """TinyGPT whose blocks break the graph: Dynamo compiles the model frame in pieces around the
    block calls and each block's frame separately (one compiled graph reused by both blocks). The
    layers are called without a loop: Dynamo cannot resume a frame inside a loop and would run the
    whole model frame eagerly, which no backend sees."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.layers = torch.nn.ModuleList(BrokenBlock(cfg) for _ in range(2))

    def forward(self, input_ids):
        x = self.embed(input_ids)
        x = self.layers[0](x)
        x = self.layers[1](x)
        return self.lm_head(self.norm(x))


def shapes(n: int) -> list[tuple[int, int]]:
    rng = random.Random(0)
    return [(rng.randint(2, 4), rng.randint(2, 60)) for _ in range(n)]


def test_backend_counts_equal_instrument_across_graph_breaks():
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = BrokenGPT(CFG)
    counter = fxflops.backend("aot_eager", model=model, strict=True)
    compiled = torch.compile(model, backend=counter, dynamic=True)
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    for b, s in shapes(20):
        ids = torch.randint(0, 100, (b, s))
        counter.flops.reset()
        wrapper.flops.reset()
        compiled(ids).sum().backward()
        wrapper(ids).sum().backward()
        for phase in ("fwd", "bwd", None):
            assert counter.flops.total(phase=phase) == wrapper.flops.total(phase=phase), (b, s, phase)
        by_module = counter.flops.breakdown()
        for path, flops in wrapper.flops.breakdown().items():
            assert by_module.get(path, 0) == flops, (b, s, path)
    assert counter.graphs >= 3, "the graph breaks give several graphs"
    assert counter.flops.uncounted == 0


def test_backend_adds_no_recompilation_and_keeps_outputs():
    """Same shapes through the inner backend alone and through the counter: the same number of
    compiled graphs, and bitwise the same outputs."""
    torch.manual_seed(0)
    model = BrokenGPT(CFG)
    inner_calls = []

    def inner(gm, example_inputs):
        inner_calls.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    inputs = [torch.randint(0, 100, (b, s)) for b, s in shapes(8)]
    torch._dynamo.reset()
    plain = torch.compile(model, backend=inner, dynamic=True)
    expected = [plain(ids) for ids in inputs]
    alone = len(inner_calls)
    torch._dynamo.reset()
    counter = fxflops.backend(inner)
    counted = torch.compile(model, backend=counter, dynamic=True)
    for ids, out in zip(inputs, expected):
        torch.testing.assert_close(counted(ids), out, rtol=0, atol=0)
    assert len(inner_calls) - alone == alone  # the inner backend compiled the same graphs, no more


def test_symbols_are_named_after_the_inputs():
    torch._dynamo.reset()
    counter = fxflops.backend("eager")
    compiled = torch.compile(TinyGPT(CFG), backend=counter, dynamic=True)
    with torch.no_grad():
        compiled(torch.randint(0, 100, (3, 17)))
    assert [str(s) for s in counter.programs[0].symbols] == ["input_ids_0", "input_ids_1"]
    assert counter.flops.total(phase="bwd") == 0  # a no_grad forward counts the forward only
    assert counter.flops.total() == fxflops.trace(TinyGPT(CFG), (torch.randint(0, 100, (3, 17)),)).total(input_ids_0=3, input_ids_1=17)


# --- torch.compile on top of instrument(), and instrument() of a compiled model ------------------


def _compiled_orders(model: torch.nn.Module, backend: str):
    """Both orders: the model compiled and then instrumented, and the instrumented wrapper compiled;
    each as (what to call, the wrapper that counts)."""
    inner = fxflops.instrument(torch.compile(model, backend=backend, dynamic=True), backward=True, strict=True)
    outer_wrapper = fxflops.instrument(model, backward=True, strict=True)
    outer = torch.compile(outer_wrapper, backend=backend, dynamic=True)
    return {"instrument(compile(model))": (inner, inner), "compile(instrument(model))": (outer, outer_wrapper)}


def test_either_compile_order_counts_every_call_exactly():
    """Forward-and-backward and no-grad calls at changing shapes: each order counts what FlopCounterMode
    counts on the plain model for the same call, returns the plain model's outputs, and names the
    modules as the model does."""
    from reference import flop_counter_call

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BrokenGPT(CFG)
    for order, (call, wrapper) in _compiled_orders(model, "aot_eager").items():
        for i, (b, s) in enumerate(shapes(6)):
            ids = torch.randint(0, 100, (b, s))
            grad = i % 3 != 2
            before = wrapper.flops.total()
            with torch.set_grad_enabled(grad):
                out = call(ids)
                if grad:
                    out.sum().backward()
                expected_out = model(ids)
            torch.testing.assert_close(out, expected_out)
            with torch.set_grad_enabled(grad):
                expected = flop_counter_call(model, (ids,), {}, backward=grad)
            assert wrapper.flops.total() - before == expected, (order, b, s, grad)
        assert wrapper.flops.uncounted == 0, order
        assert "layers.0.attn" in wrapper.flops.breakdown(), order  # no "_orig_mod." prefix
        model.zero_grad()


def test_a_compiled_submodule_is_captured_as_written():
    """A model holding a compiled submodule: the capture runs the submodule's original code."""
    from reference import flop_counter_call

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    model.layers[1].mlp = torch.compile(model.layers[1].mlp, backend="aot_eager", dynamic=True)
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    for b, s in shapes(4):
        ids = torch.randint(0, 100, (b, s))
        before = wrapper.flops.total()
        wrapper(ids).sum().backward()
        assert wrapper.flops.total() - before == flop_counter_call(model, (ids,), {}, backward=True), (b, s)
    assert wrapper.captures == 1


class _TrainOnlyBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.extra = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), False

    def forward(self, x):
        x = self.a(x)
        if self.training or self.extra:  # a train-only auxiliary branch; a flag (an adapter's) too
            x = self.b(x)
        return x


def test_the_state_a_compiled_submodule_reads_is_the_call_s_situation():
    """The attributes a compiled submodule's original code reads (its ``training`` flag, a flag set
    on the original module) are guarded as a plain submodule's are (was: the capture ran the user's
    original module, not its copy, so nothing it read was recorded: ``model.eval()`` kept the train
    program, 34816 vs 18432 FLOPs). Forward and training calls, each change both ways."""
    from reference import flop_counter_call

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.compile(_TrainOnlyBranch(), backend="eager"), torch.nn.Linear(16, 4))
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    inner = model[0]._orig_mod
    steps = [
        ("train", lambda: model.train()), ("eval", lambda: model.eval()), ("flag set", lambda: setattr(inner, "extra", True)),
        ("flag unset", lambda: setattr(inner, "extra", False)), ("train again", lambda: model.train()),
    ]
    for label, change in steps:
        change()
        for backward in (False, True):
            x = torch.randn(8, 16)
            wrapper.flops.reset()
            out = wrapper(x)
            if backward:
                out.sum().backward()
            assert wrapper.flops.total() == flop_counter_call(model, (x,), {}, backward=backward), (label, backward)
