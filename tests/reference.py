"""The independent reference: FlopCounterMode on a real forward, with its CPU-attention bug corrected.

FlopCounterMode counts ``aten._scaled_dot_product_flash_attention_for_cpu`` as 0 FLOPs (wrong: the CPU
kernel does the full QKᵀ and P·V work). The correction: run SDPA on the MATH backend, which computes the
same attention as explicit ``bmm`` calls that FlopCounterMode does count (4·b·h·s_q·s_k·d, GQA at query
heads, causal not halved, exactly the convention fxflops follows). No number comes from fxflops.
"""

from __future__ import annotations

import contextlib
import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from fxflops.conventions import FLOPCOUNTER


def reference_counts(model: torch.nn.Module, *args, **kwargs) -> dict[str, int]:
    """Per-module forward FLOPs by module path (``""`` = root) from FlopCounterMode, MATH SDPA."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*args, **kwargs)
    root = type(model).__name__
    counts = {}
    for name, per_op in counter.get_flop_counts().items():
        if name == "Global":
            continue
        path = "" if name == root else name[len(root) + 1 :]
        counts[path] = sum(per_op.values())
    counts.setdefault("", counter.get_total_flops())
    return counts


def count_and_compare(
    wrapper, reference_model: torch.nn.Module, inputs: tuple, label: object
) -> tuple[dict[str, int], dict[str, int]]:
    """Count one call with an ``instrument()`` wrapper and assert every module FlopCounterMode
    tracks in ``reference_model`` has the same FLOPs; returns (fxflops' breakdown, the reference)."""
    expected = reference_counts(reference_model, *inputs)
    wrapper.flops.reset()
    with torch.no_grad():
        wrapper(*inputs)
    got = wrapper.flops.breakdown()
    for path, flops in expected.items():
        assert got[path] == flops, (label, path)
    return got, expected


@contextlib.contextmanager
def flop_counter_with_cpu_attention():
    """FlopCounterMode with the CPU flash attention kernels counted by torch's own SDPA formulas.

    FlopCounterMode registers no formula for ``_scaled_dot_product_flash_attention_for_cpu`` and its
    backward, so it counts them as 0 (wrong: the kernels do the full work). This registers torch's
    ``sdpa_flop_count`` / ``sdpa_backward_flop_count`` for them for the duration of the block.
    """
    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    ops = {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }
    for op, formula in ops.items():
        flop_counter.flop_registry[op] = flop_counter.shape_wrapper(formula)
    try:
        yield
    finally:
        for op in ops:
            del flop_counter.flop_registry[op]


class GroupsAsSeparateConvs(torch.nn.Module):
    """A grouped convolution computed as one groups=1 convolution per group (the same arithmetic).

    FlopCounterMode's grouped-conv backward counts the weight gradient ``groups`` times too often;
    for groups=1 convolutions it is right, so this is the reference form of a grouped conv.
    """

    def __init__(self, conv: torch.nn.modules.conv._ConvNd) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, g = self.conv, self.conv.groups
        xs, ws = x.chunk(g, dim=1), conv.weight.chunk(g, dim=1 if conv.transposed else 0)
        bias = conv.bias.chunk(g) if conv.bias is not None else [None] * g
        if conv.transposed:
            fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[x.dim() - 2]
            outs = [fn(xi, wi, bi, conv.stride, conv.padding, conv.output_padding, 1, conv.dilation) for xi, wi, bi in zip(xs, ws, bias)]
        else:
            fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[x.dim() - 2]
            outs = [fn(xi, wi, bi, conv.stride, conv.padding, conv.dilation, 1) for xi, wi, bi in zip(xs, ws, bias)]
        return torch.cat(outs, dim=1)


def degrouped(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every grouped convolution as separate per-group convolutions (a deep copy when
    something inside is replaced)."""
    if isinstance(model, torch.nn.modules.conv._ConvNd) and model.groups > 1:
        return GroupsAsSeparateConvs(model)
    done = {id(m.conv) for m in model.modules() if isinstance(m, GroupsAsSeparateConvs)}  # degrouped already
    if not any(isinstance(m, torch.nn.modules.conv._ConvNd) and m.groups > 1 and id(m) not in done for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    done = {id(m.conv) for m in model.modules() if isinstance(m, GroupsAsSeparateConvs)}
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.modules.conv._ConvNd) and module.groups > 1 and id(module) not in done:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, GroupsAsSeparateConvs(module))
    return model


def flop_counter_call(model: torch.nn.Module, args: tuple, kwargs: dict, backward: bool) -> int:
    """FlopCounterMode's FLOPs of one call ``model(*args, **kwargs)`` exactly as made (the caller's
    grad and autocast modes, the model's state), with CPU attention counted and grouped convolutions
    degrouped; with ``backward``, plus ``.sum().backward()`` of the float outputs when they require
    grad (recompute of activation checkpointing included)."""
    reference = degrouped(model)
    with flop_counter_with_cpu_attention(), FlopCounterMode(display=False) as counter:
        out = reference(*args, **kwargs)
        floats = [t for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()]
        if backward and any(t.requires_grad for t in floats):
            sum(t.float().sum() for t in floats if t.requires_grad).backward()
    return counter.get_total_flops()


def assert_counted_call(wrapper, model: torch.nn.Module, args: tuple, backward: bool, label: object, kwargs: dict | None = None) -> None:
    """One call of ``wrapper`` (its backward too with ``backward``: ``.sum().backward()`` of its
    output), counted with nothing uncounted and equal to :func:`flop_counter_call` of ``model``."""
    kwargs = kwargs or {}
    wrapper.flops.reset()
    out = wrapper(*args, **kwargs)
    if backward:
        out.sum().backward()
    assert wrapper.flops.uncounted == 0, label
    assert wrapper.flops.total() == flop_counter_call(model, args, kwargs, backward=backward), label


def training_reference_total(model: torch.nn.Module, *args) -> int:
    """FLOPs of forward + ``loss.backward()`` (loss = sum of the float outputs) from FlopCounterMode,
    with CPU attention counted and grouped convolutions degrouped (see above)."""
    reference = degrouped(model)
    with flop_counter_with_cpu_attention(), FlopCounterMode(display=False) as counter:
        out = reference(*args)
        sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()).backward()
    return counter.get_total_flops()


def model_training_reference_total(model: torch.nn.Module, *args) -> int:
    """Model FLOPs of forward + ``loss.backward()``: FlopCounterMode with SDPA on the MATH backend,
    whose backward is explicit bmm's (dQ, dK, dV, dP: 2x the forward, no recomputed scores). Fused
    kernels also recompute Q·Kᵀ in their backward; fxflops bills that to the ``recompute`` phase, so
    its fwd + bwd phases equal this and its total equals :func:`training_reference_total`."""
    reference = degrouped(model)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = reference(*args)
        sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()).backward()
    return counter.get_total_flops()


def _clone_leaf(value):
    if torch.is_tensor(value):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def _replayed(names: dict[torch.nn.Module, str], step) -> dict[str, int]:
    """Record every call of the modules in ``names`` during ``step()`` (a real forward + backward:
    inputs with their requires_grad, and which outputs really received a gradient), then replay each
    alone under FlopCounterMode (CPU attention counted, grouped convolutions degrouped) with a
    backward from exactly those outputs. A module called twice sums both calls."""
    calls = []

    def record(module, call_args, call_kwargs, output):
        outputs = [t for t in torch.utils._pytree.tree_leaves(output) if torch.is_tensor(t)]
        got_grad = [False] * len(outputs)
        for i, t in enumerate(outputs):
            if t.requires_grad:
                t.register_hook(lambda grad, i=i: got_grad.__setitem__(i, True))
        calls.append((names[module], module, torch.utils._pytree.tree_map(_clone_leaf, (call_args, call_kwargs)), got_grad))

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in names]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    counts: dict[str, int] = {}
    for path, module, (call_args, call_kwargs), got_grad in calls:
        alone = degrouped(module)
        with flop_counter_with_cpu_attention(), FlopCounterMode(display=False) as counter:
            outputs = [t for t in torch.utils._pytree.tree_leaves(alone(*call_args, **call_kwargs)) if torch.is_tensor(t)]
            roots = [t for t, g in zip(outputs, got_grad) if g and t.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        counts[path] = counts.get(path, 0) + counter.get_total_flops()
    return counts


def per_module_training_reference(model: torch.nn.Module, *args) -> dict[str, int]:
    """Forward + backward FLOPs of every module, each measured on its own (:func:`_replayed`).

    FlopCounterMode's per-module backward attribution is a heuristic (a module counts as "in
    backward" from its output gradients to its input gradients, so sibling branches such as k_proj and
    v_proj absorb each other's backward). The root is the whole-model count of
    ``training_reference_total``; the step's loss is the sum of the floating outputs.
    """

    def step():
        out = model(*args)
        sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()).backward()

    counts = _replayed({m: n for n, m in model.named_modules() if m is not model}, step)
    counts[""] = training_reference_total(model, *args)
    return counts


def flop_counter_modules(model: torch.nn.Module, batch: dict, backward: bool) -> dict[str, int]:
    """FlopCounterMode's FLOPs per module path ("" = the whole model) for one forward (+ backward of
    the loss) of ``model`` on ``batch``. Per module, trust it for the forward only: its backward
    attribution is a heuristic that here even gives ``model`` less than its child ``model.language_model``
    (see :func:`replayed_training_counts`). The forward runs with grad enabled either way: under
    no_grad, FlopCounterMode's module tracker raises on a view of a parameter (which then requires
    grad without a grad_fn: Idefics2's perceiver latents, ``latents.unsqueeze(0).expand(...)``); the
    forward's ops and FLOPs are the same."""
    model.train(backward)
    with torch.enable_grad(), FlopCounterMode(display=False) as counter:
        out = model(**batch, use_cache=False)
        if backward:
            out.loss.backward()
    root = type(model).__name__
    counts = {"": counter.get_total_flops()}
    for name, per_op in counter.get_flop_counts().items():
        if name.startswith(root + "."):
            counts[name[len(root) + 1 :]] = sum(per_op.values())
    return counts


def replayed_training_counts(model: torch.nn.Module, batch: dict, paths: list[str]) -> dict[str, int]:
    """Forward + backward FLOPs of each module in ``paths`` of a Hugging Face model, each measured on
    its own (:func:`_replayed`) from a real forward + ``loss.backward()`` on ``batch``."""

    def step():
        model.train()
        model(**batch, use_cache=False).loss.backward()

    return _replayed({model.get_submodule(path): path for path in paths}, step)


MODEL_FLOPS = FLOPCOUNTER.but(name="fwd+bwd", recompute=False)
"""fxflops' model FLOPs: forward + backward, without the Q·Kᵀ a fused attention backward recomputes
(eager attention, the reference's, never recomputes it)."""


def assert_training_call_matches(wrapper, reference: torch.nn.Module, batch: dict, paths: list[str], label: object) -> tuple[dict, ...]:
    """One training call of a Hugging Face ``wrapper`` (forward + ``loss.backward()``) against
    FlopCounterMode on the same batch through ``reference`` (eager attention): the forward per
    module, the training FLOPs per module replayed alone, the whole step's total at ``""``; asserts
    the root and every path in ``paths`` equal. Returns (fxflops forward, fxflops model FLOPs,
    reference forward, reference training) breakdowns for further checks."""
    forward = flop_counter_modules(reference, batch, backward=False)
    training = replayed_training_counts(reference, batch, paths)
    training[""] = flop_counter_modules(reference, batch, backward=True)[""]
    wrapper.flops.reset()
    wrapper(**batch).loss.backward()
    got_forward = wrapper.flops.breakdown(phase="fwd")
    got_training = wrapper.flops.breakdown(convention=MODEL_FLOPS)
    for path in ["", *paths]:
        where = (label, path or "<model>")
        assert got_forward.get(path, 0) == forward.get(path, 0), where
        assert got_training.get(path, 0) == training.get(path, 0), where
    return got_forward, got_training, forward, training


def with_attention(model: torch.nn.Module, attn: str) -> torch.nn.Module:
    """``model`` itself for eager attention, else a copy of it with attention implementation ``attn``
    (the same weights: the eager model stays the reference)."""
    if attn == "eager":
        return model
    other = copy.deepcopy(model)
    other.set_attn_implementation(attn)
    return other


def assert_count_on_host_and_device(program, batch: dict, expected: int) -> None:
    """``program`` counts ``batch`` as ``expected`` with its metadata read on the host and with tensor
    ops (as for inputs on an accelerator: ``binder.host_metadata = False``)."""
    assert program.count(**batch) == expected
    program.binder.host_metadata = False
    try:
        assert program.count(**batch) == expected
    finally:
        program.binder.host_metadata = True


def random_calls(make_batch, seed: str, training: bool, calls: int = 10, text_only: tuple[int, ...] = (3, 7)) -> list[dict]:
    """``calls`` random batches ``make_batch(rng, images)`` from one rng seeded ``seed``, text-only at
    the indices ``text_only``; their labels dropped unless ``training``."""
    rng = random.Random(seed)
    batches = [make_batch(rng, i not in text_only) for i in range(calls)]
    if not training:
        for batch in batches:
            del batch["labels"]
    return batches


def assert_forward_per_module(wrapper, reference: torch.nn.Module, batches: list[dict], label: object) -> None:
    """Each batch through ``wrapper`` under no_grad: its total (> 0) and every module FlopCounterMode
    names on ``reference`` (eager attention) equal FlopCounterMode's."""
    for i, batch in enumerate(batches):
        expected = flop_counter_modules(reference, batch, backward=False)
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(**batch)
        got = wrapper.flops.breakdown()
        assert got[""] == expected[""] > 0, (label, i)
        for path, flops in expected.items():
            assert got.get(path) == flops, (label, i, path)


def assert_symbolic_in(wrapper, symbol: str, programs: int = 1, captures: int = 2) -> None:
    """The image calls went through 1 to ``programs`` programs in ``symbol`` (a derived size, tiles),
    from at most ``captures`` captures; nothing measured, uncounted or unsupported."""
    assert wrapper.measured == {} and wrapper.flops.uncounted == 0
    within = [p for p in wrapper.programs if symbol in map(str, p.all_symbols)]
    assert 1 <= len(within) <= programs and wrapper.captures <= captures, [p.symbols for p in wrapper.programs]
    assert not any(p.unsupported for p in wrapper.programs)


def assert_measured_without_tokens(wrapper, model: torch.nn.Module, batch: dict, token: int, embedding: str) -> None:
    """``batch`` (its media and ``token``s in ``input_ids``) counted by ``wrapper``'s program; the same
    media without the tokens (the model skips ``embedding``: outside the program's guard, at least one
    token) captured again and measured, as FlopCounterMode counts it; one token more than the media
    give rejected by the model itself, nothing added."""
    with torch.no_grad():
        wrapper(**batch)
    without = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["input_ids"] == token, 60))
    for call in (without, batch):
        wrapper.flops.reset()
        with torch.no_grad():
            wrapper(**call)
        expected = flop_counter_modules(model, call, backward=False)
        assert wrapper.flops.total() == expected[""] > 0 and wrapper.flops.uncounted == 0
    assert expected.get(embedding, 0) > 0 and flop_counter_modules(model, without, backward=False).get(embedding, 0) == 0
    assert set(wrapper.measured) == {embedding.rpartition(".")[0]}
    wrong = batch["input_ids"].clone()
    wrong[0, 0] = token  # one token more than the media give
    before = wrapper.flops.total()
    try:
        with torch.no_grad():
            wrapper(**dict(batch, input_ids=wrong))
    except Exception:  # noqa: BLE001 - the model's own index_put rejects it, not fxflops
        pass
    else:
        raise AssertionError("the model accepted more tokens than its media give")
    assert wrapper.flops.total() == before


def assert_matmul_count_exact_and_count_all_refused(wrapper, program, model: torch.nn.Module, batch: dict, derived: str) -> None:
    """``program`` (holding the derived size ``derived``, whose stand-ins leave elementwise work out of
    the trace) counts ``batch`` as FlopCounterMode does, on the host and with tensor ops; the wrapper's
    ``count="all"`` is refused naming ``derived``, its matmul-family total is exact."""
    expected = flop_counter_modules(model, batch, backward=False)[""]
    assert_count_on_host_and_device(program, batch, expected)
    with pytest.raises(ValueError, match=derived):
        wrapper.flops.total(convention=FLOPCOUNTER.but(count="all"))
    assert wrapper.flops.total() == expected
