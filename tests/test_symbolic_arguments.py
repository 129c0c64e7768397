"""Python int arguments traced as symbols (``dims={"keep": "keep"}``; transformers' per-batch ints
``max_length_q``/``max_length_k``/``num_items_in_batch``, capture/adapters.py): one program serves
every value, each call counted exactly; where the model's code branches on the value, the branch
is a guard and the other side gets its own program. Every count is compared with FlopCounterMode
on the same call."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

import fxflops
from reference import assert_counted_call, flop_counter_call, flop_counter_with_cpu_attention


class Truncating(nn.Module):
    """``keep`` bounds the rows computed (``narrow``: a slice ``x[:, :keep]`` would make a size the
    trace cannot name, as the slice clamps its bound), and above 6 a second layer runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.extra, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, keep: int):
        h = torch.relu(self.fc(x.narrow(1, 0, keep)))
        if keep > 6:
            h = self.extra(h)
        return self.head(h)


@pytest.mark.parametrize("backward", [False, True])
def test_an_int_argument_named_in_dims_is_a_symbol(backward):
    model = Truncating()
    wrapper = fxflops.instrument(model, dims={"keep": "keep"}, backward=backward, on_miss="recapture")
    for batch, keep in [(3, 5), (2, 3), (4, 8), (2, 9), (3, 1), (2, 7), (3, 4)]:
        assert_counted_call(wrapper, model, (torch.randn(batch, 9, 8, requires_grad=backward), keep), backward, (batch, keep))
    # one program per side of `keep > 6` (and of `keep == 1`, a size 1), not one per value
    assert wrapper.captures <= 3
    assert all("keep" in {str(s) for s in program.symbols} for program in wrapper.programs)


def test_a_program_binds_the_int_argument_and_guards_its_branch():
    model = Truncating()
    x = torch.randn(2, 9, 8)
    program = fxflops.trace(model, (x, 5), dims={"keep": "keep"})
    for keep in (1, 4, 6):
        assert program.count(x, keep) == flop_counter_call(model, (x, keep), {}, backward=False), keep
    with pytest.raises(fxflops.GuardError, match="keep"):
        program.count(x, 8)


def test_a_symbol_name_for_an_argument_the_call_lacks_is_refused():
    with pytest.raises(fxflops.InputError, match=r"dims\['kept'\] is a symbol name for a Python int argument, but the call has no argument 'kept'"):
        fxflops.trace(Truncating(), (torch.randn(2, 9, 8), 5), dims={"kept": "rows"})


def test_a_non_int_value_of_a_symbolic_argument_is_its_own_situation():
    """``scale`` given as a float or a tensor after ints: not the int program's call."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, scale):
            return self.fc(x) * scale

    model = Scaled()
    wrapper = fxflops.instrument(model, dims={"scale": "scale"})
    x = torch.randn(3, 8)
    with torch.no_grad():
        for scale in (2, 3, 0.5, torch.tensor(2.0)):
            wrapper.flops.reset()
            wrapper(x, scale)
            assert wrapper.flops.total() == flop_counter_call(model, (x, scale), {}, backward=False)
    assert wrapper.captures == 3


def test_a_padding_free_collators_max_lengths_need_no_new_program():
    """transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` passes the batch's
    longest sequence as Python ints that change with every batch: one program counts every batch
    exactly (keyed by value, each batch was a new situation, and past ``max_programs`` measured)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).train()
    wrapper = fxflops.instrument(model, backward=True)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rng = random.Random(5)
    lengths = set()
    for _ in range(5):
        features = [{"input_ids": [rng.randrange(1, 128) for _ in range(rng.randint(2, 12))]} for _ in range(rng.randint(2, 4))]
        batch = dict(collator(features, return_tensors="pt"))
        assert isinstance(batch["max_length_q"], int)
        lengths.add(batch["max_length_q"])
        wrapper.flops.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapper(**batch).loss.backward()
        with flop_counter_with_cpu_attention(), torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            model(**batch).loss.backward()
        assert wrapper.flops.total() == counter.get_total_flops()
        assert wrapper.flops.uncounted == 0
    assert len(lengths) > 1 and wrapper.captures == 1
