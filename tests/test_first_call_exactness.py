"""A capture is exact for the very call it sees, and its guards hold it to the calls it is exact for.

Three ways a capture went wrong on its FIRST call, or let a later call use a program that was not
exact for it:

- repeated layers that differ (a ``_private`` flag, a list, a held config, a plain tensor's value,
  a Python list of modules) billed as copies of an earlier one (``capture/reuse.py``);
- size-0/1 conditions decided size-obliviously without a guard (``x.numel() == 0`` at batch 4 then
  reused at batch 0), or against the example (``squeeze(1)`` of a ``t = 1`` example traced as if
  ``t != 1``) (``capture/shape_env.py``, ``capture/symbols.py``);
- inputs faked contiguous and dense whatever their layout: a transposed, broadcast, channels-last or
  sliced input, an inference tensor; kinds a dense fake cannot stand for (sparse, nested, conj/neg
  views) are refused naming the input (``capture/symbols.py``, ``capture/inputs.py``).

Every count is compared with FlopCounterMode on the same call (``reference.flop_counter_call``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxflops
from fxflops.capture.adapters import Adapter
from reference import flop_counter_call


def count_each(wrapper, model: nn.Module, calls: list[tuple], backward: bool = False) -> None:
    """Each call through ``wrapper`` counts what FlopCounterMode counts for it on ``model``."""
    for args in calls:
        wrapper.flops.reset()
        if backward:
            out = wrapper(*args)
            out.sum().backward()
        else:
            with torch.no_grad():
                wrapper(*args)
        with torch.set_grad_enabled(backward):
            expected = flop_counter_call(model, args, {}, backward=backward)
        assert (wrapper.flops.total(), wrapper.flops.uncounted) == (expected, 0), [tuple(a.shape) for a in args]


# --- 1. repeated layers that differ are traced, not billed as copies -----------------------------


class Config:
    def __init__(self, n: int) -> None:
        self.n = n


def once(x, fc):
    return fc(x)


def twice(x, fc):
    return fc(fc(x))


class Layer(nn.Module):
    """Runs ``fc`` a number of times that each attribute below decides."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self._extra = False
        self.reps = [1]
        self.cfg = Config(1)
        self.count = torch.tensor(1)
        self.subs = [nn.Linear(8, 8)]
        self.mode = {"n": 1}
        self.act = once

    def forward(self, x):
        x = self.act(x, self.fc)
        if self._extra:
            x = self.fc(x)
        for _ in self.reps:
            x = self.fc(x)
        for _ in range(self.cfg.n + int(self.count) + self.mode["n"]):
            x = self.fc(x)
        for sub in self.subs:
            x = sub(x)
        return x


class Stack(nn.Module):
    def __init__(self, change=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        if change is not None:
            change(self.layers[2])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


DIFFERENCES = {
    "private flag": lambda layer: setattr(layer, "_extra", True),
    "list": lambda layer: setattr(layer, "reps", [1, 1, 1]),
    "held object": lambda layer: setattr(layer, "cfg", Config(3)),
    "plain tensor value": lambda layer: setattr(layer, "count", torch.tensor(3)),
    "python list of modules": lambda layer: setattr(layer, "subs", [nn.Linear(8, 8) for _ in range(3)]),
    "dict": lambda layer: setattr(layer, "mode", {"n": 2}),
    "function": lambda layer: setattr(layer, "act", twice),
    "submodule hook": lambda layer: layer.fc.register_forward_hook(lambda m, args, out: out + 1),
}


@pytest.mark.parametrize("difference", list(DIFFERENCES))
def test_a_layer_differing_in_any_attribute_is_traced_on_the_first_call(difference):
    torch.manual_seed(0)
    model = Stack(DIFFERENCES[difference])
    x = torch.randn(4, 8)
    with torch.no_grad():  # every layer called alike: an input without grad
        program = fxflops.trace(model, (x,), dims={"x": {0: "rows"}})
        assert program.reused == {"layers.1": "layers.0"}  # the equal ones still are
        assert program.count(x) == flop_counter_call(model, (x,), {}, backward=False)
    count_each(fxflops.instrument(model, backward=True), model, [(torch.randn(4, 8, requires_grad=True),)], backward=True)


def test_layers_alike_are_reused_whatever_objects_hold_their_values():
    """Equal values in distinct objects (each layer its own config object, list, tensor, lambda made
    alike) are the same kind of layer: the sameness test is by value, not identity."""
    model = Stack()
    for layer in model.layers:
        layer.scale = (lambda k: lambda x: x * k)(2)
    with torch.no_grad():
        program = fxflops.trace(model, (torch.randn(4, 8),), dims={"x": {0: "rows"}})
    assert program.reused == {"layers.1": "layers.0", "layers.2": "layers.0"}


class IndexedLayer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.index = index  # only labels the layer

    def forward(self, x):
        return self.fc(x)


class IndexedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(IndexedLayer(i) for i in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class IgnoringIndex(Adapter):
    same_layer_attributes = frozenset({"index"})


def test_attributes_an_adapter_names_are_ignored_and_only_those():
    from fxflops.capture.trace import capture

    x, dims = torch.randn(3, 8), {"x": {0: "rows"}}
    with torch.no_grad():
        assert capture(IndexedStack(), (x,), dims=dims).reused == {}
        assert capture(IndexedStack(), (x,), dims=dims, adapter=IgnoringIndex()).reused == {"layers.1": "layers.0", "layers.2": "layers.0"}


# --- 2. sizes 0 and 1 --------------------------------------------------------------------------


def branching(condition):
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            y = self.a(x)
            if condition(x):
                y = self.a(torch.ones(2, 8))
            return y

    return Branch()


CONDITIONS = {
    "shape[0] == 0": lambda x: x.shape[0] == 0,
    "numel() == 0": lambda x: x.numel() == 0,
    "not numel()": lambda x: not x.numel(),
    "shape[0] < 1": lambda x: x.shape[0] < 1,
    "not shape[0] > 0": lambda x: not x.shape[0] > 0,
    "shape[0] == 1": lambda x: x.shape[0] == 1,
    "shape[0] <= 1": lambda x: x.shape[0] <= 1,
}


@pytest.mark.parametrize("batches", [(4, 0, 1, 3), (0, 4, 1), (1, 4, 0)], ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_size_zero_and_one_branches_count_every_call_exactly(condition, batches):
    model = branching(CONDITIONS[condition])
    count_each(fxflops.instrument(model), model, [(torch.randn(b, 8),) for b in batches])


def test_a_program_traced_at_batch_four_refuses_batch_zero():
    """The guard ``Ne(8*batch, 0)`` (the model's ``x.numel() == 0``) is kept: the public symbols are
    positive, and sympy called it true."""
    model = branching(CONDITIONS["numel() == 0"])
    program = fxflops.trace(model, (torch.randn(4, 8),), dims={"x": {0: "batch"}})
    assert any(str(g.expr) == "Ne(8*batch, 0)" for g in program.guards)
    with pytest.raises(fxflops.GuardError, match="batch"):
        program.total(batch=0)


class Squeezing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):  # (b, t, 8): squeeze(1) drops t only when it is 1
        x = x.squeeze(1)
        if x.dim() == 3:
            return self.a(x)
        return self.a(self.a(x))


@pytest.mark.parametrize("ts", [(1, 3, 1), (3, 1, 3)], ids=lambda t: "-".join(map(str, t)))
def test_squeeze_of_a_size_one_dim_is_traced_as_the_example_has_it(ts):
    model = Squeezing()
    count_each(fxflops.instrument(model), model, [(torch.randn(2, t, 8),) for t in ts])


def test_a_size_one_decision_is_a_guard_not_a_pin():
    """At ``t = 1`` squeeze drops the dim: the program holds at ``t = 1`` only, by a guard blamed on
    the squeeze line; ``t`` stays a symbol (not an error for requested dims)."""
    model = Squeezing()
    program = fxflops.trace(model, (torch.randn(2, 1, 8),), dims={"x": {1: "t"}})
    assert [str(g.expr) for g in program.guards] == ["Eq(t, 1)"]
    assert "x.squeeze(1)" in program.guards[0].location
    assert program.total(t=1) == flop_counter_call(model, (torch.randn(2, 1, 8),), {}, backward=False)
    with pytest.raises(fxflops.GuardError, match="Eq\\(t, 1\\)"):
        program.total(t=3)


# --- 3. input layouts and kinds ----------------------------------------------------------------


class Contiguity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.is_contiguous():
            return self.fc(x)
        return self.fc(self.fc(x.contiguous()))


class Strides(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.stride(0) == 8:
            return self.fc(x)
        return self.fc(self.fc(x))


class ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if x.is_contiguous(memory_format=torch.channels_last):
            return self.conv(self.conv(torch.zeros(x.shape[0], 3, 6, 6))[:, :3])
        return self.conv(x)


class Inference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if x.is_inference():
            x = self.a(x)
        return self.a(x)


def inference_tensor(*shape: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.randn(*shape)


LAYOUTS = {
    "transposed": (Contiguity, lambda b: torch.randn(8, b).t()),
    "transposed strides": (Strides, lambda b: torch.randn(8, b).t()),
    "broadcast": (Contiguity, lambda b: torch.randn(1, 8).expand(b, 8)),
    "slice of a wider tensor": (Strides, lambda b: torch.randn(b, 16)[:, :8]),
    "channels last": (ChannelsLast, lambda b: torch.randn(b, 3, 6, 6).to(memory_format=torch.channels_last)),
    "inference tensor": (Inference, lambda b: inference_tensor(b, 8)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_input_is_traced_in_its_own_layout(layout):
    factory, make = LAYOUTS[layout]
    model = factory()
    count_each(fxflops.instrument(model), model, [(make(4),), (make(3),)])
    program = fxflops.trace(model, (make(4),))
    for b in (2, 5):
        with torch.no_grad():
            assert program.count(make(b)) == flop_counter_call(model, (make(b),), {}, backward=False)


def test_a_layout_that_changes_at_size_one_is_guarded():
    """A transposed (b, 8) input is non-contiguous for b > 1 and contiguous at b = 1: the layout is part
    of the call (the program traced at b = 4 refuses b = 1 naming it), and the wrapper traces each."""
    model = Contiguity()
    program = fxflops.trace(model, (torch.randn(8, 4).t(),), dims={"x": {0: "batch"}})
    assert program.count(torch.randn(8, 3).t()) == flop_counter_call(model, (torch.randn(8, 3).t(),), {}, backward=False)
    with pytest.raises(fxflops.InputError, match=r"contiguous\), the program was traced with .*non-contiguous, dims in memory order \(1, 0\)"):
        program.count(torch.randn(8, 1).t())
    count_each(fxflops.instrument(model), model, [(torch.randn(8, b).t(),) for b in (4, 1, 3)])


def complex_input() -> torch.Tensor:
    return torch.randn(4, 8, dtype=torch.complex64)


REFUSED = {
    "sparse COO": (lambda: torch.randn(4, 8).to_sparse(), "layout torch.sparse_coo"),
    "sparse CSR": (lambda: torch.randn(4, 8).to_sparse_csr(), "layout torch.sparse_csr"),
    "conjugate view": (lambda: complex_input().conj(), "conjugate view"),
    "negative view": (lambda: torch._neg_view(complex_input()), "negative view"),
    "nested": (lambda: torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)]), "nested tensor"),
    "nested jagged": (lambda: torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)], layout=torch.jagged), "nested tensor"),
}


class Plain(nn.Module):
    def forward(self, x):
        if x.is_nested:
            return x
        if x.is_sparse:
            x = x.to_dense()
        return x.resolve_conj().resolve_neg() @ torch.ones(8, 8, dtype=x.dtype)


@pytest.mark.parametrize("kind", list(REFUSED))
def test_an_input_kind_a_dense_fake_cannot_stand_for_is_measured_or_refused_naming_it(kind):
    """No trace takes it (``trace`` refuses, naming the input); the wrapper measures the model's own
    code on such calls instead (exact where fxflops has rules for the ops that run; the sparse
    matmul of a COO input has none, and the report says its count is a lower bound), and with
    ``measure=False`` refuses them as uncounted, never a wrong number. A nested tensor is refused."""
    make, reason = REFUSED[kind]
    with pytest.raises(fxflops.CaptureError, match=f"input 'x' .*{reason}"):
        fxflops.trace(Plain(), (make(),))
    if kind.startswith("nested"):  # no sizes to measure by: refused
        wrapper = fxflops.instrument(Plain())
        with pytest.warns(UserWarning, match=f"not counted: input 'x' .*{reason}"), torch.no_grad():
            wrapper(make())
        assert (wrapper.flops.total(), wrapper.flops.uncounted) == (0, 1)
        return
    model = Plain()
    wrapper = fxflops.instrument(model)
    with torch.no_grad():
        wrapper(make())
    assert wrapper.flops.uncounted == 0
    assert wrapper.flops.total() == flop_counter_call(model, (make(),), {}, backward=False)
    assert reason in wrapper.measured[""]
    refusing = fxflops.instrument(Plain(), measure=False)
    with pytest.warns(UserWarning, match="not counted"), torch.no_grad():
        refusing(make())
    assert (refusing.flops.total(), refusing.flops.uncounted) == (0, 1)
