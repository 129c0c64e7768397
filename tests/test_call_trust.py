"""A program serves only the calls whose situation matches what its trace read, also where that state
lives outside the model's instance attributes (issue 13's promise, found wanting by hostile probes).

- Class attributes read through an instance (``self.use_extra`` with ``use_extra = False`` on the
  class): set on the instance, changed on the class, shadowed by a subclass.
- Attributes the trace found absent: ``getattr(self, "more", 0)``, ``hasattr(self, "tail")``, then
  set; and an attribute set while traced, then deleted.
- A method patched on the class (``nn.Linear.forward``, a model class's ``forward``).
- Hugging Face: ``GradientCheckpointingLayer.gradient_checkpointing`` (a class default) set on one
  layer of a stack whose layers are billed as copies of the first; ``loss_function`` replaced.

Each change in both directions, every call compared with FlopCounterMode on the same call.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxflops
from reference import flop_counter_call


class Knobs(nn.Module):
    use_extra = False  # a class default the forward reads through the instance

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if self.use_extra:
            h = self.extra(h)
        for _ in range(getattr(self, "more", 0)):
            h = self.extra(h)
        if hasattr(self, "tail"):
            h = self.tail(h)
        return h


def _check(wrapper, model, backward: bool, label: str) -> None:
    x = torch.randn(5, 8)
    wrapper.flops.reset()
    out = wrapper(x)
    if backward:
        out.sum().backward()
    assert wrapper.flops.uncounted == 0, label
    assert wrapper.flops.total() == flop_counter_call(model, (x,), {}, backward), label


class _Shadow(Knobs):
    pass


@pytest.mark.parametrize("backward", [False, True])
def test_class_and_absent_attributes_guard_their_programs(backward):
    model = Knobs()
    wrapper = fxflops.instrument(model, backward=backward)
    steps = [
        ("traced", lambda: None),
        ("set on the instance over the class default", lambda: setattr(model, "use_extra", True)),
        ("instance attribute deleted: the class default again", lambda: delattr(model, "use_extra")),
        ("changed on the class", lambda: setattr(Knobs, "use_extra", True)),
        ("class back", lambda: setattr(Knobs, "use_extra", False)),
        ("getattr default replaced", lambda: setattr(model, "more", 2)),
        ("getattr default again", lambda: delattr(model, "more")),
        ("hasattr becomes true (a plain attribute)", lambda: object.__setattr__(model, "tail", torch.relu)),
        ("hasattr false again", lambda: object.__delattr__(model, "tail")),
        ("a subclass shadows the class default", lambda: setattr(model, "__class__", _Shadow) or setattr(_Shadow, "use_extra", True)),
    ]
    try:
        for label, change in steps:
            change()
            _check(wrapper, model, backward, label)
    finally:
        Knobs.use_extra = False
        if "use_extra" in vars(_Shadow):
            del _Shadow.use_extra


def test_a_forward_patched_on_the_class_gets_its_own_program():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    wrapper = fxflops.instrument(model)
    _check(wrapper, model, False, "traced")
    original = nn.Linear.forward
    weight = torch.randn(8, 8)

    def with_adapter(self, x):  # a library patching the class (a LoRA-style extra product)
        return original(self, x @ weight[: x.shape[-1], : x.shape[-1]])

    try:
        nn.Linear.forward = with_adapter
        _check(wrapper, model, False, "nn.Linear.forward patched")
    finally:
        nn.Linear.forward = original
    _check(wrapper, model, False, "restored")


def test_hf_layer_checkpointing_class_default_and_loss_function():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).train()
    wrapper = fxflops.instrument(model, backward=True)

    def check(label):
        ids = torch.randint(0, 128, (2, 9))
        wrapper.flops.reset()
        wrapper(input_ids=ids, labels=ids).loss.backward()
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        assert wrapper.flops.uncounted == 0, label
        assert wrapper.flops.hardware_flops() == counter.get_total_flops(), label

    check("traced")
    layer = model.model.layers[1]  # billed as a copy of layers[0] in the capture
    layer.gradient_checkpointing = True  # over the class default False
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    check("one layer checkpointed")
    del layer.gradient_checkpointing
    check("class default again")
    projection = torch.randn(128, 64) * 0.01
    default_loss = model.loss_function

    def loss_with_projection(logits, labels, vocab_size, **kwargs):  # an auxiliary term with a matmul
        return default_loss(logits, labels, vocab_size, **kwargs) + (logits.float() @ projection).pow(2).mean()

    model.loss_function = loss_with_projection
    check("loss_function replaced")
