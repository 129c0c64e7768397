"""A count belongs to its call: every change of situation gets its own program (issue 13, point 1).

One plain-torch model with every kind of knob the issue lists — a ``self.training`` branch (root and
layer), frozen parameters, an input that requires grad, Python arguments (int, str, enum, bool),
an optional input given or ``None``, grad mode, autocast, activation checkpointing switched by a
flag, a replaced submodule, a held settings object — is called under random sequences of changes,
and every call's count is compared with FlopCounterMode on the same call in the same situation
(``reference.flop_counter_call``). Changes are applied in both directions.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import random

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxflops
from reference import flop_counter_call


class Kind(enum.Enum):
    PLAIN = "plain"
    GATED = "gated"


class Settings:
    """A plain object the model holds and reads (like a config)."""

    def __init__(self) -> None:
        self.depth = 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)
        self.use_gate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.fc(x))
        if self.use_gate:
            y = y * torch.sigmoid(self.gate(x))
        if self.training:  # a layer-level training branch
            y = y + self.fc(y)
        return x + y


class Switchboard(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(3)])
        self.extra = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)
        self.checkpointing = False
        self.settings = Settings()

    def forward(self, x, mask=None, repeats: int = 1, mode: str = "sum", kind: Kind = Kind.PLAIN, scale_first: bool = False):
        h = self.embed(x)
        if self.training:
            h = self.extra(h)
        for block in self.blocks[: self.settings.depth]:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointing else block(h)
        for _ in range(repeats):
            h = self.extra(h)
        if mask is not None:
            h = h * mask
        if kind is Kind.GATED:
            h = h * torch.sigmoid(self.extra(h))
        if scale_first:
            h = 2 * h
        out = self.head(h)
        return out.sum(-1) if mode == "sum" else out


@contextlib.contextmanager
def _nothing():
    yield


def _changes(model: Switchboard, original_head: nn.Module) -> list:
    """Each change flips one thing of the situation (applied at random, so both directions occur)."""
    def flip_training():
        model.train(not model.training)

    def flip_block_training():
        block = model.blocks[1]
        block.train(not block.training)

    def flip_frozen_blocks():
        frozen = not next(model.blocks.parameters()).requires_grad
        model.blocks.requires_grad_(frozen)

    def flip_frozen_embed():
        for p in model.embed.parameters():
            p.requires_grad = not p.requires_grad

    def flip_checkpointing():
        model.checkpointing = not model.checkpointing

    def flip_head():
        model.head = original_head if model.head is not original_head else nn.Linear(16, 6)

    def flip_depth():
        model.settings.depth = 2 if model.settings.depth == 3 else 3

    def flip_gate():
        model.blocks[2].use_gate = not model.blocks[2].use_gate

    return [flip_training, flip_block_training, flip_frozen_blocks, flip_frozen_embed, flip_checkpointing, flip_head, flip_depth, flip_gate]


def _random_call(rng: random.Random) -> tuple[tuple, dict, bool, str]:
    """(args, kwargs, training call, modes) of one random call. With ``backward=True`` the wrapper
    counts a grad-enabled call whose output requires grad as a training call, so the backward
    follows every such call here."""
    rows = rng.randint(2, 9)
    x = torch.randn(rows, 8)
    if rng.random() < 0.3:
        x.requires_grad_(True)
    kwargs = {}
    if rng.random() < 0.4:
        kwargs["mask"] = torch.ones(rows, 16)
    if rng.random() < 0.3:
        kwargs["repeats"] = rng.choice([0, 2])
    if rng.random() < 0.3:
        kwargs["mode"] = "all"
    if rng.random() < 0.3:
        kwargs["kind"] = Kind.GATED
    if rng.random() < 0.2:
        kwargs["scale_first"] = True
    modes = rng.choice(["plain", "plain", "autocast", "no_grad"])
    return (x,), kwargs, modes != "no_grad", modes  # a grad-enabled call is a training call


def _modes(name: str):
    return {"plain": _nothing, "no_grad": torch.no_grad, "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[name]()


def _counted(wrapper, args, kwargs, training: bool) -> int:
    wrapper.flops.reset()
    out = wrapper(*args, **kwargs)
    if training and out.requires_grad:
        out.float().sum().backward()
    assert wrapper.flops.uncounted == 0
    return wrapper.flops.total()


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.long)])
def test_every_change_of_situation_counts_its_own_call(seed):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = Switchboard()
    changes = _changes(model, model.head)
    wrapper = fxflops.instrument(model, backward=True, strict=True, max_programs=64)
    for step in range(30 if seed else 20):  # the long suite's seed takes more steps
        if step:
            for change in rng.sample(changes, rng.randint(1, 2)):
                change()
        args, kwargs, training, modes = _random_call(rng)
        with _modes(modes):
            got = _counted(wrapper, args, kwargs, training)
            expected = flop_counter_call(model, args, kwargs, backward=training)
        assert got == expected, (step, modes, training, kwargs)
    assert 1 < wrapper.captures <= 30


def test_each_change_alone_in_both_directions():
    """Every change, applied and undone, between two otherwise identical calls: the count follows."""
    torch.manual_seed(0)
    model = Switchboard()
    wrapper = fxflops.instrument(model, backward=True, strict=True, max_programs=64)
    x = torch.randn(5, 8)
    baseline = _counted(wrapper, (x,), {}, True)
    assert baseline == flop_counter_call(model, (x,), {}, backward=True)
    for change in _changes(model, model.head):
        change()
        changed = _counted(wrapper, (x,), {}, True)
        assert changed == flop_counter_call(model, (x,), {}, backward=True), change.__name__
        change()
        assert _counted(wrapper, (x,), {}, True) == baseline, change.__name__
    for kwargs in ({"mask": torch.ones(5, 16)}, {"repeats": 3}, {"mode": "all"}, {"kind": Kind.GATED}, {"scale_first": True}):
        assert _counted(wrapper, (x,), kwargs, True) == flop_counter_call(model, (x,), kwargs, backward=True), kwargs
        assert _counted(wrapper, (x,), {}, True) == baseline, kwargs
    grad_input = x.clone().requires_grad_(True)
    assert _counted(wrapper, (grad_input,), {}, True) == flop_counter_call(model, (grad_input,), {}, backward=True)
    assert _counted(wrapper, (x,), {}, True) == baseline
    with torch.no_grad():
        assert _counted(wrapper, (x,), {}, False) == flop_counter_call(model, (x,), {}, backward=False)
    assert _counted(wrapper, (x,), {}, True) == baseline


def test_none_for_an_optional_input_traced_as_a_tensor():
    """Previously an AttributeError out of the wrapper: now its own program, exact both ways."""
    model = Switchboard()
    wrapper = fxflops.instrument(model, strict=True)
    x, mask = torch.randn(4, 8), torch.ones(4, 16)
    for given in (mask, None, mask, None):
        with torch.no_grad():
            assert _counted(wrapper, (x,), {"mask": given}, False) == flop_counter_call(model, (x,), {"mask": given}, backward=False)
    assert wrapper.captures == 2


def test_a_call_outside_the_traced_situation_is_refused_with_on_miss_raise():
    model = Switchboard()
    wrapper = fxflops.instrument(model, on_miss="raise")
    with torch.no_grad():
        wrapper(torch.randn(4, 8))
        model.eval()
        with pytest.raises(fxflops.GuardError, match="training is False, the program was traced with True"):
            wrapper(torch.randn(4, 8))
        model.train()
        with pytest.raises(fxflops.GuardError, match="'repeats' is 2, the program was traced with 1"):
            wrapper(torch.randn(4, 8), repeats=2)
    with pytest.raises(fxflops.GuardError, match="grad mode is on, the program was traced with off"):
        wrapper(torch.randn(4, 8))


def test_program_count_checks_the_call_and_the_model_state():
    model = Switchboard()
    program = fxflops.trace(model, (torch.randn(4, 8),))
    assert program.count(torch.randn(6, 8)) == flop_counter_call(model, (torch.randn(6, 8),), {}, backward=False)
    with pytest.raises(fxflops.InputError, match="'mask' is a Tensor"):
        program.count(torch.randn(6, 8), mask=torch.ones(6, 16))
    model.settings.depth = 2
    with pytest.raises(fxflops.GuardError, match=r"settings.depth is 2, the program was traced with 3"):
        program.count(torch.randn(6, 8))
    model.settings.depth = 3
    model.head = nn.Linear(16, 5)
    with pytest.raises(fxflops.GuardError, match="structure of Switchboard changed"):
        program.count(torch.randn(6, 8))


def test_changes_no_registration_hook_sees_are_caught_at_the_next_step():
    """``param.data = ...`` with another shape, or a forward pre-hook added, fire no registration
    hook; the model's structure is checked again after every ``Meter.step()``."""
    model = Switchboard()
    wrapper = fxflops.instrument(model, strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        wrapper(x)
        model.head.weight.data = torch.randn(7, 16)
        model.head.bias.data = torch.randn(7)
        wrapper.flops.step()
        assert _counted(wrapper, (x,), {}, False) == flop_counter_call(model, (x,), {}, backward=False)
        model.head.register_forward_pre_hook(lambda module, inputs: (torch.cat([inputs[0], inputs[0]]),))
        wrapper.flops.step()
        assert _counted(wrapper, (x,), {}, False) == flop_counter_call(model, (x,), {}, backward=False)
    assert wrapper.captures == 3


class _Cubed(nn.Module):
    def forward(self, weight):
        return weight @ weight.T @ weight


def _parametrized() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    nn.utils.parametrize.register_parametrization(model[0], "weight", _Cubed())
    return model


@pytest.mark.parametrize("backward", [False, True])
def test_parametrized_weights_under_parametrize_cached_count_as_they_run(backward):
    """Inside ``torch.nn.utils.parametrize.cached()`` a parametrized weight is computed on its first
    read in the context and found on the later ones: such calls are measured (exact), the calls
    outside keep their program (was: every call counted as computing it, 3072 vs 1024 FLOPs).
    The reference is a second model built alike (a deepcopy would share torch's cache key)."""
    model, reference, x = _parametrized(), _parametrized(), torch.randn(4, 8)
    wrapper = fxflops.instrument(model, backward=backward)
    grad = contextlib.nullcontext() if backward else torch.no_grad()

    def counted(label: str) -> None:
        wrapper.flops.reset()
        out = wrapper(x)
        if backward:
            out.sum().backward()
        assert wrapper.flops.uncounted == 0, label
        assert wrapper.flops.total() == flop_counter_call(reference, (x,), {}, backward=backward), label

    with grad:
        counted("outside")
        for context in range(2):
            with nn.utils.parametrize.cached():
                for call in range(1 if backward else 3):  # a training step reads it once per context
                    counted(f"context {context}, call {call}")
        counted("outside again")
    assert len(wrapper.programs) == 1 and wrapper.measured


class _Batch(dict):
    pass


class _Items(list):
    pass


class _Ordered(collections.OrderedDict):
    pass


ARGUMENT_CONTAINERS = {  # how the call holds its tensor; whether one capture serves every size
    "dict": (lambda x: {"x": x}, True),
    "deque": (lambda x: collections.deque([x]), True),
    "dict subclass": (lambda x: _Batch(x=x), False),
    "list subclass": (lambda x: _Items([x]), False),
    "OrderedDict subclass": (lambda x: _Ordered(x=x), False),
}


class _ReadsItsContainer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, batch):
        return self.fc(batch["x"] if isinstance(batch, dict) else batch[0])


@pytest.mark.parametrize("container", ARGUMENT_CONTAINERS)
def test_tensors_in_any_argument_container_are_counted_per_call(container):
    """A container torch's pytree does not flatten (a ``dict`` or ``list`` subclass) is one leaf to
    the trace, its tensors constants: their shapes are the call's key, each size its own situation
    (was: every call counted as the first, 3072 FLOPs for a batch of 64). One pytree flattens
    (a ``deque``) holds inputs like a list (was: every call refused as an internal error)."""
    make, symbolic = ARGUMENT_CONTAINERS[container]
    model = _ReadsItsContainer()
    wrapper = fxflops.instrument(model, backward=True)
    for rows in (3, 5, 64, 0):
        x = torch.randn(rows, 16)
        wrapper.flops.reset()
        wrapper(make(x)).sum().backward()
        assert wrapper.flops.uncounted == 0
        assert wrapper.flops.total() == flop_counter_call(model, (make(x),), {}, backward=True), rows
    assert wrapper.captures == (1 if symbolic else 4)
