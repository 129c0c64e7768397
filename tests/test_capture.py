"""Capture behaviour: duck sizing, 0/1 examples, guards, pinned dims, unsupported ops, errors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.models.tiny_gpt import GPTConfig, TinyGPT
from reference import per_module_training_reference, reference_counts


class Branchy(nn.Module):
    """Takes an extra layer only for long inputs: a shape-dependent branch (a guard)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)

    def forward(self, x):
        x = self.fc(x)
        if x.shape[1] > 32:  # BRANCH LINE
            x = self.extra(x)
        return x


class Pinning(nn.Module):
    """Adds a fixed-size positional table: the code forces seq == 64."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(64, 16))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x + self.pos)  # PIN LINE


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "def line_of" not in line)


def test_duck_sizing_does_not_merge_seq_with_hidden():
    """seq = 64 = hidden size in the example: seq must still be a free symbol."""
    model = TinyGPT(GPTConfig(vocab=100, hidden=64, heads=4, kv_heads=2, ffn=64, layers=1))
    program = fxflops.trace(model, (torch.randint(0, 100, (2, 64)),), dims={"input_ids": {1: "seq"}})
    assert [str(s) for s in program.symbols] == ["seq"]
    ids = torch.randint(0, 100, (2, 37))
    assert program.total(seq=37) == reference_counts(model, ids)[""]


def test_size_one_examples_do_not_specialise():
    """batch = 1 and seq = 1 in the example: both stay free and count other sizes exactly."""
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=1))
    program = fxflops.trace(model, (torch.randint(0, 100, (1, 1)),), dims={"input_ids": {0: "b", 1: "s"}})
    assert {str(s) for s in program.symbols} == {"b", "s"}
    for b, s in [(1, 1), (3, 17), (2, 64)]:
        ids = torch.randint(0, 100, (b, s))
        assert program.total(b=b, s=s) == reference_counts(model, ids)[""]


def test_zero_config_names_every_dim():
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=1))
    program = fxflops.trace(model, (torch.randint(0, 100, (2, 9)),))
    assert [str(s) for s in program.symbols] == ["input_ids_0", "input_ids_1"]


def test_shape_dependent_branch_records_guard_with_model_line():
    program = fxflops.trace(Branchy(), (torch.randn(2, 40, 16),), dims={"x": {1: "seq"}})
    assert len(program.guards) == 1
    guard = program.guards[0]
    assert str(guard.expr) == "seq > 32"
    assert f"test_capture.py:{line_of('BRANCH LINE')}" in guard.location
    assert program.total(seq=33) == 2 * (2 * 2 * 33 * 16 * 16)
    with pytest.raises(fxflops.GuardError, match=r"seq > 32.*test_capture.py"):
        program.total(seq=10)


def test_branch_miss_recaptures_by_default_and_raises_on_request():
    model = Branchy()
    wrapper = fxflops.instrument(model, dims={"x": {1: "seq"}})
    for seq in (40, 10, 50, 5):
        x = torch.randn(2, seq, 16)
        wrapper.flops.reset()
        wrapper(x)
        assert wrapper.flops.total() == reference_counts(model, x)[""]
    assert wrapper.captures == 2  # one program per side of the branch

    strict = fxflops.instrument(Branchy(), dims={"x": {1: "seq"}}, on_miss="raise")
    strict(torch.randn(2, 40, 16))
    with pytest.raises(fxflops.GuardError, match="seq > 32"):
        strict(torch.randn(2, 10, 16))


def test_pinned_symbol_names_the_model_line():
    with pytest.raises(fxflops.PinnedSymbolError) as err:
        fxflops.trace(Pinning(), (torch.randn(2, 64, 16),), dims={"x": {1: "seq"}})
    message = str(err.value)
    assert "'seq'" in message and "fixed to 64" in message
    assert f"test_capture.py:{line_of('PIN LINE')}" in message


def test_zero_config_accepts_pins_as_constants():
    """dims=None is like Dim.AUTO: a dim the code pins becomes a constant, the others stay free."""
    program = fxflops.trace(Pinning(), (torch.randn(3, 64, 16),))
    assert [str(s) for s in program.symbols] == ["x_0"]
    assert program.total(x_0=5) == 2 * 5 * 64 * 16 * 16


def test_unsupported_op_is_listed_and_warned_once():
    class Spectral(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.fft.rfft(self.fc(x), dim=-1).abs() + torch.fft.rfft(x, dim=-1).abs()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = fxflops.trace(Spectral(), (torch.randn(4, 8),), dims={"x": {0: "n"}})
    ops = {u.op for u in program.unsupported}
    assert ops == {"aten._fft_r2c.default"} and len(program.unsupported) == 2
    fft_warnings = [w for w in caught if "_fft_r2c" in str(w.message)]
    assert len(fft_warnings) == 1, "one warning per op, not per node"
    assert program.total(n=4) == 2 * 4 * 8 * 8  # the counted part stays exact


def test_missing_symbol_value_is_an_error():
    program = fxflops.trace(Branchy(), (torch.randn(2, 40, 16),), dims={"x": {0: "batch", 1: "seq"}})
    with pytest.raises(fxflops.UnboundSymbolError, match="batch"):
        program.total(seq=40)


def test_input_outside_traced_static_dims_is_refused_with_its_name():
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=1))
    program = fxflops.trace(model, (torch.randint(0, 100, (2, 9)),), dims={"input_ids": {1: "seq"}})
    with pytest.raises(fxflops.InputError, match=r"'input_ids' dim 0 is 3.*= 2"):
        program.count(torch.randint(0, 100, (3, 9)))
    wrapper = fxflops.instrument(model, dims={"input_ids": {1: "seq"}}, on_miss="raise")
    wrapper(torch.randint(0, 100, (2, 9)))
    with pytest.raises(fxflops.GuardError, match="input_ids"):
        wrapper(torch.randint(0, 100, (3, 9)))


def test_wrong_rank_is_an_input_error_not_an_index_error():
    program = fxflops.trace(Branchy(), (torch.randn(2, 40, 16),), dims={"x": {1: "seq"}})
    with pytest.raises(fxflops.InputError, match="'x' has rank 1"):
        program.count(torch.randn(16))


def test_bad_dims_are_reported():
    with pytest.raises(fxflops.InputError, match=r"input 'ids'.*\['x'\]"):
        fxflops.trace(Branchy(), (torch.randn(2, 40, 16),), dims={"ids": {1: "seq"}})
    with pytest.raises(fxflops.InputError, match="rank 3"):
        fxflops.trace(Branchy(), (torch.randn(2, 40, 16),), dims={"x": {5: "seq"}})


def test_data_dependent_model_fails_open_unless_strict():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            keep = int((x > 0).sum())  # reads tensor data: no shape can say this
            return self.fc(x[:keep])

    x = torch.randn(6, 4)
    lenient = fxflops.instrument(DataDependent(), measure=False)  # symbolic only: refused
    with pytest.warns(UserWarning, match="not counted"):
        out = lenient(x)
    assert out.shape[1] == 4 and lenient.flops.uncounted == 1 and lenient.flops.calls == 0

    strict = fxflops.instrument(DataDependent(), strict=True, measure=False)
    with pytest.raises(fxflops.CaptureError, match="DataDependent"):
        strict(x)

    measured = fxflops.instrument(DataDependent(), strict=True)  # by default the root's own code is measured
    measured(x)
    rows = min(int((x > 0).sum()), x.shape[0])  # x[:keep] keeps at most every row
    assert measured.flops.total() == 2 * rows * 4 * 4 and list(measured.measured) == [""]  # fc on the kept rows


def test_instrument_leaves_the_model_untouched():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=2))
    hooks_before = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}
    wrapper = fxflops.instrument(model)
    ids = torch.randint(0, 100, (2, 11))
    torch.testing.assert_close(wrapper(ids), model(ids), rtol=0, atol=0)
    assert list(wrapper.state_dict()) == list(model.state_dict())
    assert [id(p) for p in wrapper.parameters()] == [id(p) for p in model.parameters()]
    assert wrapper.cfg is model.cfg  # attribute access falls through to the model
    hooks_after = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}
    assert hooks_after == hooks_before
    wrapper.eval()
    assert not model.training


def test_the_wrapper_training_flag_is_the_models_whichever_side_sets_it():
    """A loop or framework reading ``wrapper.training`` (Lightning, HF Trainer, a user's own check)
    sees the mode the model runs in, also when ``train()``/``eval()`` was called on the model itself,
    and a copy keeps its own flag."""
    import copy
    import pickle

    model = TinyGPT(GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=1))
    model.eval()
    wrapper = fxflops.instrument(model)
    assert wrapper.training is False
    model.train()
    assert wrapper.training is True
    model.eval()
    assert wrapper.training is False and "training" not in vars(wrapper)
    wrapper.train()
    assert model.training and model.layers[0].training and wrapper.training
    wrapper.training = False  # as torch's own Module.train sets it
    assert model.training is False
    for twin in (copy.deepcopy(wrapper), pickle.loads(pickle.dumps(wrapper))):
        twin.train()
        assert twin.training and twin.wrapped_model.training and not wrapper.training


class RootWithItsOwnStateDict(nn.Module):
    """A root that customises its state dict: extra state, and old checkpoints' keys renamed on load."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.version = nn.Linear(4, 4), 3

    def get_extra_state(self):
        return {"version": self.version}

    def set_extra_state(self, state):
        self.version = state["version"]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "fc.w" in state_dict:  # an old checkpoint's name
            state_dict[prefix + "fc.weight"] = state_dict.pop(prefix + "fc.w")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        return self.fc(x)


def test_the_wrapper_s_state_dict_is_the_model_s_own():
    """Saving and loading through the wrapper is the model's own: its extra state, its override
    of loading, and hooks on its root (both ways between wrapper and model)."""
    model = RootWithItsOwnStateDict()
    model.register_state_dict_post_hook(lambda module, state, prefix, local: state.__setitem__(prefix + "format", torch.tensor(2)))
    wrapper = fxflops.instrument(model)
    wrapper(torch.randn(2, 4))
    saved = model.state_dict()
    assert list(wrapper.state_dict()) == list(saved) and "_extra_state" in saved and "format" in saved
    assert list(nn.ModuleDict({"inner": wrapper}).state_dict()) == [f"inner.{k}" for k in saved]  # nested too
    saved.pop("format")
    model.version = 0
    wrapper.load_state_dict(saved)
    assert model.version == 3
    old = {("fc.w" if k == "fc.weight" else k): v for k, v in saved.items()}
    wrapper.load_state_dict(old)  # renamed by the model's own override
    model.load_state_dict({k: v for k, v in wrapper.state_dict().items() if k != "format"})


def test_capture_does_not_touch_real_buffers():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxflops.trace(model, (torch.randn(2, 3, 8, 8),))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_to_json_and_table():
    program = fxflops.trace(Branchy(), (torch.randn(2, 40, 16),), dims={"x": {1: "seq"}})
    doc = json.loads(program.to_json())
    assert doc["symbols"] == ["seq"]
    assert doc["modules"]["fc"]["fwd"] == "1024*seq"
    assert doc["guards"][0]["expr"] == "seq > 32"
    table = program.table(seq=40)
    assert "fc" in table and "81,920" in table and "50.0%" in table


def test_size_one_outside_a_guard_recaptures_exactly():
    """einsum's contraction relies on seq != 1; a seq = 1 call gets its own exact program.

    The seq = 1 branch (captured at batch 3) in turn relies on batch != 1, so (1, 1) is a third branch.
    """
    from zoo import EinsumAttention

    model = EinsumAttention()
    wrapper = fxflops.instrument(model, dims={"x": {0: "batch", 1: "seq"}})
    wrapper(torch.randn(2, 9, 48))
    assert any("Ne(seq, 1)" in str(g.expr) for g in wrapper.program.guards)
    for shape in [(3, 1, 48), (2, 5, 48), (1, 1, 48)]:
        x = torch.randn(*shape)
        wrapper.flops.reset()
        wrapper(x)
        assert wrapper.flops.total() == reference_counts(model, x)[""]
    assert wrapper.captures == 3
    assert [str(s) for s in wrapper.programs[1].symbols] == ["batch"]  # seq pinned to 1 there


class Keyworded(nn.Module):
    """Nested and keyword inputs: a list of tensors, an optional mask, a keyword-only scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.mix = nn.Linear(8, 8, bias=False)

    def forward(self, x, extras, mask=None, *, scale=1.0):
        y = self.fc(x) * scale
        for e in extras:
            y = y + self.mix(e).sum(dim=1, keepdim=True)
        return y if mask is None else y * mask


def test_nested_and_keyword_inputs_bind_by_name_in_any_layout():
    model = Keyworded()
    x, extras, mask = torch.randn(2, 5, 8), [torch.randn(2, 3, 8), torch.randn(2, 7, 8)], torch.ones(2, 5, 1)
    dims = {"x": {1: "seq"}, "extras_0": {1: "a"}, "extras_1": {1: "b"}, "mask": {1: "seq"}}
    wrapper = fxflops.instrument(model, dims=dims, on_miss="raise")
    wrapper(x, extras, mask)
    x2, extras2, mask2 = torch.randn(2, 9, 8), [torch.randn(2, 4, 8), torch.randn(2, 1, 8)], torch.ones(2, 9, 1)
    expected = reference_counts(model, x2, extras2, mask2)[""]
    for call in (  # one call in three layouts, the default scale given or left out: one situation
        lambda: wrapper(x2, extras2, mask2, scale=1.0),
        lambda: wrapper(x2, extras=extras2, mask=mask2),
        lambda: wrapper(mask=mask2, extras=extras2, x=x2),
    ):
        wrapper.flops.reset()
        call()
        assert wrapper.flops.total() == expected
    assert wrapper.captures == 1
    assert [str(s) for s in wrapper.program.symbols] == ["a", "b", "seq"]
    with pytest.raises(fxflops.InputError, match="'mask' dim 1 is 4.*= seq"):
        wrapper.program.count(x2, extras2, torch.ones(2, 4, 1))
    # a Python argument that reaches the traced code is part of the call: another scale is another
    # situation (refused here, on_miss="raise"; captured by default)
    with pytest.raises(fxflops.GuardError, match="'scale' is 0.5, the program was traced with 1.0"):
        wrapper(x2, extras2, mask2, scale=0.5)
    with pytest.raises(fxflops.InputError, match="'scale' is 0.5"):
        wrapper.program.count(x2, extras2, mask2, scale=0.5)


def test_reserved_symbol_names_are_refused():
    with pytest.raises(fxflops.InputError, match="phase"):
        fxflops.trace(Branchy(), (torch.randn(2, 40, 16),), dims={"x": {1: "phase"}})


@torch.library.custom_op("fxflops_test::scaled_matmul", mutates_args=())
def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return (a @ b) * scale


@scaled_matmul.register_fake
def _(a, b, scale):
    return a.new_empty(a.shape[0], b.shape[1])


def test_custom_op_is_unsupported_until_a_rule_is_registered():
    class UsesCustomOp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(12, 20))

        def forward(self, x):
            return scaled_matmul(x, self.w, 0.5)

    model, x = UsesCustomOp(), torch.randn(7, 12)
    with pytest.warns(UserWarning, match="fxflops_test.scaled_matmul"):
        before = fxflops.trace(model, (x,), dims={"x": {0: "rows"}})
    assert [u.op for u in before.unsupported] == ["fxflops_test.scaled_matmul.default"]

    def scaled_matmul_flops(a, b, scale, out_shape=None):
        """(m,k)@(k,n) then a scale: 2·m·k·n (the scale is elementwise, not counted)."""
        return 2 * a[0] * a[1] * b[1]

    rules = {torch.ops.fxflops_test.scaled_matmul: scaled_matmul_flops}
    after = fxflops.trace(model, (x,), dims={"x": {0: "rows"}}, rules=rules)  # this trace only
    assert not after.unsupported
    assert after.total(rows=30) == 2 * 30 * 12 * 20
    assert fxflops.rules.rule_for(torch.ops.fxflops_test.scaled_matmul) is None  # the registry untouched
    wrapper = fxflops.instrument(model, dims={"x": {0: "rows"}}, rules=rules, strict=True)
    for rows in (3, 9):  # every capture of the wrapper uses them
        wrapper(torch.randn(rows, 12))
    assert wrapper.flops.total() == 2 * (3 + 9) * 12 * 20 and not wrapper.program.unsupported
    with pytest.raises(TypeError, match="not callable"):  # a wrong rule is the user's error, raised at once
        fxflops.instrument(model, rules={torch.ops.fxflops_test.scaled_matmul: 3})
    with pytest.raises(ValueError, match="kind"):
        fxflops.trace(model, (x,), rules={torch.ops.fxflops_test.scaled_matmul: fxflops.rules.Entry(scaled_matmul_flops, kind="pointwise")})


def test_elementwise_work_on_data_dependent_sizes_is_noted_not_counted():
    """A pointwise op on a size only data gives (``.item()``) has no closed form: under count="all"
    it is left out with a note, and the matmul count is unaffected."""

    class DataSized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4, bias=False)

        def forward(self, x, n):
            return self.fc(x), torch.ones(n.max().item()) * 2

    program = fxflops.trace(DataSized(), (torch.randn(3, 4), torch.tensor([5])), dims={"x": {0: "rows"}})
    assert any("data-dependent sizes" in note for note in program.notes)
    assert program.count(torch.randn(6, 4), torch.tensor([9])) == 2 * 6 * 4 * 4
    everything = fxflops.conventions.FLOPCOUNTER.but(count="all")
    assert program.total(convention=everything, rows=6) == 2 * 6 * 4 * 4


def test_unfold_fold_and_polar_are_classified():
    """``F.unfold`` / ``F.fold`` (im2col / col2im: patches gathered and scattered back) move data;
    ``torch.polar`` is pointwise (1 FLOP per complex output element under count="all"): none of them
    is unsupported, and the matmul count equals FlopCounterMode's."""

    class Patches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3 * 4 * 4, 8, bias=False)

        def forward(self, x, angles):
            patches = F.unfold(x, kernel_size=4, stride=4)  # (B, 48, L)
            back = F.fold(patches, x.shape[-2:], kernel_size=4, stride=4)
            rotary = torch.polar(torch.ones_like(angles), angles)
            return self.proj(patches.transpose(1, 2)), back, rotary

    x, angles = torch.randn(2, 3, 8, 12), torch.randn(5, 6)
    program = fxflops.trace(Patches(), (x, angles))
    assert not program.unsupported
    with FlopCounterMode(display=False) as reference:
        Patches()(x, angles)
    assert program.count(x, angles) == reference.get_total_flops() == 2 * 2 * 6 * 48 * 8
    everything = fxflops.conventions.FLOPCOUNTER.but(count="all")
    assert str(program.formula(convention=everything) - program.formula()) == "angles_0*angles_1"  # polar's output


class IndexedLayer(nn.Module):
    """A layer that branches on its own index: only its attributes tell it apart from its siblings."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.fc = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x):
        x = self.fc(x)
        return self.extra(x) if self.index % 2 else x


class IndexedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(IndexedLayer(i) for i in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_identical_layers_are_traced_once_and_distinct_ones_each():
    from fxflops.models.tiny_gpt import forward_flops_formula

    cfg = GPTConfig(vocab=100, hidden=32, heads=2, kv_heads=1, ffn=48, layers=4)
    program = fxflops.trace(TinyGPT(cfg), (torch.randint(0, 100, (2, 9)),), dims={"input_ids": {0: "b", 1: "s"}})
    assert program.reused == {f"layers.{i}": "layers.0" for i in (1, 2, 3)}
    assert program.total(b=3, s=17) == forward_flops_formula(cfg, 3, 17)
    model = IndexedStack()  # its index is a plain attribute: every layer is its own kind
    program = fxflops.trace(model, (torch.randn(3, 8),), dims={"x": {0: "rows"}})
    assert program.reused == {}
    assert program.total(rows=5) == reference_counts(model, torch.randn(5, 8))[""] == 2 * 5 * 8 * 8 * 6


class MLPLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class SharedActivationStack(nn.Module):
    """Repeated layers, and one activation module held at two paths (Phi-4-multimodal's audio
    encoder does this): make_fx then records module paths through access proxies."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.pre = nn.Sequential(nn.Linear(8, 8), self.act)
        self.layers = nn.ModuleList(MLPLayer() for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.act(self.pre(x))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_repeated_layers_count_under_their_paths_when_a_module_is_shared():
    """A module held at two paths makes make_fx record each submodule through an access proxy; the
    repeated layers' template must keep its full path, or the repeats bill nothing (was: one layer
    of three counted, at the root)."""
    model = SharedActivationStack()
    program = fxflops.trace(model, (torch.randn(3, 8),), dims={"x": {0: "rows"}})
    assert program.reused == {"layers.1": "layers.0", "layers.2": "layers.0"}
    expected = reference_counts(model, torch.randn(5, 8))
    got = program.breakdown(rows=5)
    assert got[""] == expected[""] == 2 * 5 * (8 * 8 + 3 * 2 * 8 * 16 + 8 * 4)
    for path, flops in expected.items():
        assert got.get(path) == flops, path


class BlocksInAPlainList(nn.Module):
    """Two blocks called from a Python list (not a ModuleList), and one activation module held by
    both: make_fx records paths through access proxies, and the blocks are reached from a plain object."""

    def __init__(self) -> None:
        super().__init__()
        act = nn.ReLU()
        self.first, self.second = MLPLayer(), MLPLayer()
        self.first.act = self.second.act = act
        self.order = [self.second, self.first]  # the call order is not the registration order
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.order:
            x = x + block.act(block(x))
        return self.head(x)


def test_modules_reached_from_a_plain_object_count_under_their_paths_when_a_module_is_shared():
    """A block reached from a Python list while some module is shared: its children were recorded by
    attribute name alone (``up``, ``down``), the blocks themselves billed 0. Forward and training,
    every module against FlopCounterMode."""
    model = BlocksInAPlainList()
    program = fxflops.trace(model, (torch.randn(3, 8, requires_grad=True),), dims={"x": {0: "rows"}}, backward=True)
    assert not {"up", "down", "act"} & set(program.modules())
    forward = reference_counts(model, torch.randn(5, 8))
    assert forward["first"] == forward["second"] == 2 * (2 * 5 * 8 * 16)  # up + down, 5 rows
    got = program.breakdown(rows=5, phase="fwd")
    for path, flops in forward.items():
        assert got.get(path) == flops, path
    training = per_module_training_reference(model, torch.randn(5, 8, requires_grad=True))
    got = program.breakdown(rows=5)
    for path, flops in training.items():
        assert got.get(path) == flops, path


@pytest.mark.long  # two models traced twice each, a transformers VLM among them
def test_a_model_on_the_meta_device_traces_to_the_program_of_its_real_weights():
    """Planning without weights: a model built under ``torch.device("meta")`` is traced with its
    parameters faked on the call's device, and every module's formula is that of the same model with
    real weights (plain torch, and a transformers VLM through its adapter, forward and backward)."""
    import random

    from fxflops.models import hf_zoo

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=100, hidden=32, heads=4, kv_heads=2, ffn=48, layers=2)
    with torch.device("meta"):
        weightless = [TinyGPT(cfg), hf_zoo.build("qwen2_vl", "sdpa")]
    real = [TinyGPT(cfg), hf_zoo.build("qwen2_vl", "sdpa")]
    calls = [((torch.randint(0, 100, (2, 9)),), {}), ((), hf_zoo.random_batch("qwen2_vl", random.Random(0), images=2))]
    for meta_model, model, (args, kwargs) in zip(weightless, real, calls):
        assert next(meta_model.parameters()).device.type == "meta"
        planned = fxflops.trace(meta_model, args, kwargs, backward=True)
        traced = fxflops.trace(model, args, kwargs, backward=True)
        assert sorted(planned.modules()) == sorted(traced.modules())
        for path in traced.modules():
            assert str(planned.formula(path)) == str(traced.formula(path)), (type(model).__name__, path)


class Broadcasting(nn.Module):
    """A (rows, 1) bias and a (b, 1, 1, s) mask that broadcast against full-size tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, bias, mask):
        y = self.fc(x) + bias  # (rows, 8) + (rows, 1)
        scores = (y @ y.T).expand(mask.shape[0], 2, -1, -1)  # (b, 2, rows, rows)
        return scores.masked_fill(mask == 0, 0.0) @ y


def test_zero_config_keeps_size_one_dims_that_broadcast_constant():
    """With ``dims=None``, a size-1 dim of the example stays 1 (a free symbol there cannot broadcast);
    a call with another size there is another program, counted exactly."""
    from reference import flop_counter_call

    model = Broadcasting()
    call = (torch.randn(6, 8), torch.randn(6, 1), torch.ones(3, 1, 1, 6))
    program = fxflops.trace(model, call)
    assert {str(s) for s in program.symbols} == {"x_0", "mask_0"}  # rows (bias and mask tied to them) and b
    wrapper = fxflops.instrument(model, strict=True)
    calls = [call, (torch.randn(4, 8), torch.randn(4, 1), torch.ones(2, 1, 1, 4)),
             (torch.randn(5, 8), torch.randn(5, 8), torch.ones(1, 2, 5, 5))]  # full-size bias and mask
    for args in calls:
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(*args)
        assert wrapper.flops.total() == flop_counter_call(model, args, {}, backward=False), [a.shape for a in args]
    assert wrapper.captures == 2


class Store:
    """An argument object a forward writes to (a key-value cache)."""

    def __init__(self) -> None:
        self.keys = None


class WritesThenBroadcasts(nn.Module):
    """Fills the store, then adds a (rows, 1) bias: with ``dims=None`` the first trace (the bias's
    size-1 dim free) fails after the write, and the retry must not see the failed trace's keys."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, bias, store):
        keys = self.fc(x)
        store.keys = keys if store.keys is None else torch.cat([store.keys, keys])
        return (store.keys @ store.keys.T) @ keys + bias  # (rows, 8) + (rows, 1)


def test_a_retried_trace_starts_from_the_call_not_from_the_failed_attempt():
    from reference import flop_counter_call

    model = WritesThenBroadcasts()
    wrapper = fxflops.instrument(model, strict=True)
    for rows in (6, 4):
        store = Store()
        wrapper.flops.reset()
        with torch.no_grad():
            out = wrapper(torch.randn(rows, 8), torch.randn(rows, 1), store)
        assert out.shape == (rows, 8) and store.keys.shape == (rows, 8)  # the real call's own write only
        expected = flop_counter_call(model, (torch.randn(rows, 8), torch.randn(rows, 1), Store()), {}, backward=False)
        assert wrapper.flops.total() == expected == 2 * rows * 8 * 8 + 2 * 2 * rows * rows * 8
    assert not wrapper.measured and wrapper.captures == 1  # one symbolic program, nothing measured


class Lengths:
    """An argument object holding a tensor and a size (a key-value cache and its length)."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys, self.length = keys, keys.shape[0]


class ReadsHeldSizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, held):
        return (self.fc(x) @ held.keys.T) @ held.keys / held.length


def test_training_with_an_argument_object_that_holds_a_size():
    """The int an argument object holds is a traced SymInt input of the graph, beside its tensors:
    the traced backward collects gradients of the tensors only (once it asked a SymInt for
    ``requires_grad``: every training call of a model given a cache object was refused)."""
    from reference import flop_counter_call

    model = ReadsHeldSizes()
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    for rows, length in ((4, 6), (7, 3)):
        x, keys = torch.randn(rows, 8), torch.randn(length, 8, requires_grad=True)
        wrapper.flops.reset()
        wrapper(x, Lengths(keys)).sum().backward()
        expected = flop_counter_call(model, (x, Lengths(keys.detach().clone().requires_grad_(True))), {}, backward=True)
        assert wrapper.flops.total() == expected > 0, (rows, length)
    assert wrapper.captures == 1 and not wrapper.measured


class InPlaceOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)  # refused on a leaf that requires grad, allowed on a non-leaf
        return self.fc(x)


def test_a_non_leaf_input_that_requires_grad_is_traced_as_a_non_leaf():
    """``x.clone()`` of a leaf requiring grad is no leaf: in-place ops on it work in the trace as in
    the model, forward and training count exactly and the gradient reaches the leaf."""
    from reference import flop_counter_call

    model = InPlaceOnInput()
    wrapper = fxflops.instrument(model, backward=True, strict=True)
    for rows in (4, 7):
        leaf = torch.randn(rows, 8, requires_grad=True)
        wrapper.flops.reset()
        wrapper(leaf.clone()).sum().backward()
        expected_leaf = leaf.detach().clone().requires_grad_(True)
        assert wrapper.flops.total() == flop_counter_call(model, (expected_leaf.clone(),), {}, backward=True)
        assert torch.allclose(leaf.grad, 2 * model.fc.weight.sum(0).expand(rows, 8))
    assert wrapper.captures == 1


def test_registering_a_rule_for_an_op_that_has_one_is_refused_unless_replacing():
    from fxflops.rules.matmul import mm as mm_flops

    def other(a, b, out_shape=None):
        return 0

    with pytest.raises(ValueError, match="already has the FLOPs rule fxflops.rules.matmul.mm; pass replace=True"):
        fxflops.rules.register(torch.ops.aten.mm)(other)
    assert fxflops.rules.rule_for(torch.ops.aten.mm) is mm_flops  # unchanged
    fxflops.rules.register(torch.ops.aten.mm)(mm_flops)  # the same entry again: a no-op
    fxflops.rules.register(torch.ops.aten.mm, replace=True)(other)
    try:
        assert fxflops.rules.rule_for(torch.ops.aten.mm) is other
    finally:
        fxflops.rules.register(torch.ops.aten.mm, replace=True)(mm_flops)


def test_per_use_rules_override_a_built_in_rule_in_this_thread_only():
    """``rules=`` overrides ``aten.mm`` for one trace (here: counted as 1 FLOP per output element);
    a trace in another thread meanwhile sees the registry's rule."""
    import threading

    model, x = nn.Linear(12, 20, bias=False), torch.randn(7, 12)
    seen = {}
    inside = threading.Event()
    resume = threading.Event()

    def one_per_output(*args, out_shape=None, **kwargs):
        inside.set()
        resume.wait(30)
        return out_shape[0] * out_shape[1]

    def other_thread():
        inside.wait(30)
        seen["other"] = fxflops.trace(model, (x,), dims={"input": {0: "rows"}}).total(rows=7)
        resume.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    custom = fxflops.trace(model, (x,), dims={"input": {0: "rows"}}, rules={torch.ops.aten.mm: one_per_output})
    worker.join(60)
    assert custom.total(rows=7) == 7 * 20
    assert seen["other"] == 2 * 7 * 12 * 20 == fxflops.trace(model, (x,), dims={"input": {0: "rows"}}).total(rows=7)


def test_a_failing_rule_names_the_op_the_module_and_the_graph_node():
    """A rule that raises is reported as FX reports a failing node: op, module path, and the node
    (``node.format_node()``), with the rule's own message and the original exception chained."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(12, 20, bias=False)

        def forward(self, x):
            return self.proj(x)

    def refusing(*args, out_shape=None, **kwargs):
        raise ValueError("this rule refuses its input")

    model = nn.Sequential(Block())
    with pytest.raises(fxflops.CaptureError) as caught:
        fxflops.trace(model, (torch.randn(7, 12),), dims={"input": {0: "rows"}}, rules={torch.ops.aten.mm: refusing})
    message = str(caught.value)
    assert "aten.mm" in message and "'0.proj'" in message and "this rule refuses its input" in message
    assert "While analysing graph node %mm" in message and "torch.ops.aten.mm" in message
    assert isinstance(caught.value.__cause__, ValueError)


class _ReadsValues(nn.Module):
    """Branches on its input's values (``if (x > 0).any()``) when ``reads``; else a Linear."""

    def __init__(self, reads: bool, inner: nn.Module | None = None):
        super().__init__()
        self.reads, self.inner, self.proj = reads, inner, nn.Linear(8, 8)

    def forward(self, x):
        x = self.proj(x) if self.inner is None else self.inner(self.proj(x))
        if self.reads and (x > 0).any():
            return x * 2
        return x


@pytest.mark.parametrize("where", ["", "inner", "inner.inner"])
def test_a_data_dependent_line_is_refused_naming_its_module(where):
    """The refusal names the innermost module whose forward holds the line (root, middle, leaf)."""
    leaf = _ReadsValues(where == "inner.inner")
    model = _ReadsValues(where == "", _ReadsValues(where == "inner", leaf))
    with pytest.raises(fxflops.CaptureError) as caught:
        fxflops.trace(model, (torch.randn(3, 8),), dims={"x": {0: "b"}})
    assert f"in module {where or '<root>'!r} at " in str(caught.value) and "(x > 0).any()" in str(caught.value)


class _Warns:
    """An object whose every attribute read warns (torch's deprecated ``torch.distributed.reduce_op``)."""

    __module__ = "torch.distributed.distributed_c10d"

    def __getattribute__(self, name):
        warnings.warn("deprecated", FutureWarning, stacklevel=2)
        return object.__getattribute__(self, name)


class _EngineState:
    """A distributed engine's per-module state whose hook reaches ``_Warns`` (FSDP2's reaches
    ``reduce_op``); its class is torch.distributed's, as FSDP2's ``FSDPState`` is."""

    __module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"

    def __init__(self) -> None:
        self.reduce = _Warns()

    def pre_forward(self, module, args):
        return None


def _sharded() -> nn.Module:
    layer = nn.Linear(8, 8)
    layer.register_forward_pre_hook(_EngineState().pre_forward)
    return layer


def test_identical_layers_holding_an_object_that_warns_on_reads_trace_under_warnings_as_errors():
    """Comparing repeated layers never reads an object whose class runs code on attribute reads
    (compared by identity): under ``-W error`` (pytest's ``filterwarnings = error``) FSDP2-sharded
    layers were refused, every call uncounted, torch's deprecation warning raised from the walk."""
    model = nn.Sequential(_sharded(), _sharded())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = fxflops.trace(model, (torch.randn(3, 8),), dims={"input": {0: "rows"}})
    assert program.total(rows=5) == reference_counts(model, torch.randn(5, 8))[""] == 2 * 2 * 5 * 8 * 8
