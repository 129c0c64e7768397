"""The symbolic graph of one call: ``make_fx(tracing_mode="symbolic")`` of a model whose inputs are
fake tensors, with the context the trace needs (``trace_graph``), and the capture-time patches that
keep conditions no FLOPs depend on out of the guards.

``capture/trace.py`` builds the fakes and symbols and turns the graph into a :class:`Captured`;
``capture/lifting.py`` traces a lifted module's one-segment stand-in with the same function.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import _AttrProxy, _ModuleStackTracer, make_fx

from fxflops.capture.derived import TracedSize
from fxflops.capture.inputs import Path, overrides_torch_functions, put
from fxflops.capture.isolation import user_tensors_read_only
from fxflops.capture.outputs import backward_roots, output_tensors
from fxflops.capture.phases import run_backward, tagging_recompute
from fxflops.capture.reads import named_modules
from fxflops.capture.reuse import LayerCalledTwice
from fxflops.capture.scope import patched
from fxflops.capture.shape_env import format_location, is_library_file, size_oblivious
from fxflops.errors import CaptureError, OtherThreadError

TENSOR = object()  # marks tensor leaves in a graph's recorded output structure


@contextlib.contextmanager
def no_stack_traces() -> Iterator[None]:
    """Skip per-node Python stack traces: ~20% of capture time, and fxflops reports module paths."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _gradients_kept(model: torch.nn.Module) -> Iterator[None]:
    """A fake gradient the block leaves on a real parameter of the model (one the trace does not
    swap for a fake: a module held unregistered; one a reentrant checkpoint's backward differentiates)
    is taken off again: its ``.grad`` as it was before. A real gradient set meanwhile (another
    thread's backward) is kept."""
    before = [(p, p.grad) for _, module in named_modules(model) for p in module.parameters(recurse=False)]
    try:
        yield
    finally:
        for tensor, grad in before:
            if isinstance(tensor.grad, FakeTensor):
                tensor.grad = grad


@contextlib.contextmanager
def _layout_oblivious() -> Iterator[None]:
    """Memory-layout questions answered without guards on the size symbols, while tracing.

    Whether a strided view is contiguous, or overlaps itself, depends on its sizes (``x[:, 1:]`` is
    contiguous only when ``x.shape[0]`` is 1), so torch's answer becomes a guard such as
    ``images != 1`` — a condition no FLOPs depend on, which would cost a second capture when one image
    comes. While tracing:

    - ``Tensor.contiguous()`` always makes a contiguous copy (either answer moves data and does no
      arithmetic; HF's causal-LM loss calls it on every step);
    - ``F.linear`` gets a contiguous input (its kernel asks whether the input is contiguous to fold the
      batch dims into one ``addmm`` or run ``matmul``: the same multiply-adds);
    - the self-overlap check of in-place writes (``copy_``'s meta function; Qwen3-VL's M-RoPE) answers
      "no overlap": the model runs in eager, where a real overlap would already have raised.

    Conditions that can change which arithmetic runs (einsum's size-1 fast path, a model's own
    ``if x.shape[0] == 1``) still become guards, and a call on the other side gets its own program.
    """
    def contiguous(self: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        return self.clone(memory_format=memory_format)

    with contextlib.ExitStack() as stack:
        linear = stack.enter_context(patched(F, "linear", lambda input, *args, **kwargs: linear(
            input.clone(memory_format=torch.contiguous_format), *args, **kwargs
        )))
        stack.enter_context(patched(torch.Tensor, "contiguous", contiguous))
        stack.enter_context(patched(torch, "_debug_has_internal_overlap", lambda tensor: 0))
        yield


@contextlib.contextmanager
def _attention_flags_as_bools() -> Iterator[None]:
    """``scaled_dot_product_attention``'s ``is_causal`` made a Python bool, while tracing.

    Model code may compute the flag from sizes: transformers' SDPA integration takes
    ``q_length > 1 and attention_mask is None and is_causal``, which *is* the symbolic ``q_length > 1``
    when it is false (a decode step's one query), and SDPA accepts only a bool. Evaluating it adds the
    guard it stands for (``seq <= 1``), so the program holds exactly where the flag is the same.
    """

    def attention(*args, **kwargs):  # the arguments as given: the function patched in may be another one (a ring attention)
        if "is_causal" in kwargs:
            kwargs["is_causal"] = bool(kwargs["is_causal"])
        elif len(args) > 5:
            args = (*args[:5], bool(args[5]), *args[6:])
        return sdpa(*args, **kwargs)

    with patched(F, "scaled_dot_product_attention", attention) as sdpa:
        yield


@contextlib.contextmanager
def _grouped_mm_any_float() -> Iterator[None]:
    """``aten._grouped_mm``'s shape function accepting every floating dtype, while tracing.

    torch's meta function repeats the CUDA kernel's BF16-only check, but the CPU kernel (and the
    count: the shapes) takes float32 too; the shapes it computes are the same, with ``out_dtype``
    defaulting to the inputs' dtype.
    """
    import torch._meta_registrations as meta

    def any_float(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        if scale_a is None and mat_a.dtype == mat_b.dtype and mat_a.dtype.is_floating_point and mat_a.dtype != torch.bfloat16:
            # the other checks, on bf16 stand-ins; the output of the inputs' own dtype
            common(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), None, None, offs, bias, scale_result, None, use_fast_accum)
            return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype or mat_a.dtype)
        return common(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)

    with patched(meta, "_meta_grouped_mm_common", any_float) as common:
        yield


@contextlib.contextmanager
def _access_paths_from_the_root() -> Iterator[None]:
    """A module reached from a plain object is recorded at its path in the model, while tracing.

    When a module of the traced model is held at two paths, make_fx's module-stack tracer records
    paths through access proxies: a child read from a proxy gets the proxy's path plus its name, but a
    child read from a plain module (one held in a Python list, a layer's forward run on the module
    itself) gets a proxy of its attribute name alone, so ``model.blocks[0].up`` would be recorded as
    ``up`` — its FLOPs billed to a module that does not exist, and to no ancestor. Such a read starts
    its proxy at the module's path in the model (the first of ``named_modules``, as without sharing);
    reads through proxies are unchanged.
    """
    def getattr_(tracer: _ModuleStackTracer, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if tracer.enable_attr_proxy and isinstance(attr_val, torch.nn.Module) and not isinstance(attr_val, _AttrProxy):
            attr = tracer.submodule_paths.get(attr_val, attr)
        return getattr_of_tracer(tracer, attr, attr_val, parameter_proxy_cache)

    with patched(_ModuleStackTracer, "getattr", getattr_) as getattr_of_tracer:
        yield


def _as_input(traced: Any, fake: Any) -> Any:
    """The traced input standing for the call's tensor that ``fake`` fakes, with that tensor's plain
    Python attributes (``x.packed = True``: model code may read them; ``symbols.fake_like``)."""
    attributes = getattr(fake, "fxflops_attributes", None) if isinstance(fake, torch.Tensor) else None
    if attributes:
        traced.__dict__.update(attributes)
    return traced


def trace_graph(
    model: torch.nn.Module,
    mode: FakeTensorMode,
    args: tuple,
    kwargs: dict,
    backward: bool = False,
    held: list[tuple[Any, Path, Any]] = (),
    non_leaf: frozenset[int] = frozenset(),
    shapes: dict[int, torch.Size] | None = None,
    roots: tuple[int, ...] | None = None,
    derived: dict[str, TracedSize] | None = None,
) -> torch.fx.GraphModule:
    """``make_fx`` of ``model(*args, **kwargs)`` whose tensors are fakes of ``mode``; with
    ``backward``, also of the backward from its loss or outputs (``backward_roots``; ``capture/phases.py``).
    A SymInt among the call's arguments (an integer traced as a symbol) is a graph input in its place.
    ``held`` are the tensors and integers held by argument objects, as (the object, the steps to the
    value below it, its fake or SymInt): graph inputs after the call's own tensors, put into the
    objects when the trace runs. ``non_leaf``: ids of input fakes standing for tensors that are not
    leaves of autograd (``x.clone()`` of a leaf that requires grad): they enter the model as such,
    a copy made inside the trace, so in-place ops that a leaf requiring grad refuses work as on the
    real tensor (the copy moves data, no FLOPs).

    Parameters and buffers enter as static-shaped fake placeholders, swapped in as
    ``functional_call`` does, for the forward and the backward: the model's real state is never read for compute nor mutated (e.g.
    BatchNorm's ``num_batches_tracked += 1``). A distributed engine's sharded parameters get the
    shape this rank computes with: ``shapes`` by parameter id, ``compute_shapes`` (``capture/engines.py``)
    of the user's model, whose engine state a twin of it is not registered for; a model on the ``meta`` device (no
    weights) has its parameters faked on the call's device. Nodes carry ``nn_module_stack`` relative to ``model``;
    ``gm.meta["output_structure"]`` keeps the output's pytree spec and its non-tensor leaves.
    ``roots``: the backward starts from these of the output's tensor leaves (by position) instead of
    :func:`backward_roots` (a module inside a measured call: the outputs its caller differentiates).
    ``derived``: the derived sizes (``capture/derived.py``), graph inputs after the state; while the
    trace runs, each entry is replaced by the traced SymInt and the traced tensor of its source, which
    the adapter's stand-ins read from the same dict.
    """
    leaves, tree = pytree.tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (torch.Tensor, torch.SymInt))]  # a SymInt: a symbolic argument
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    for name, tensor in state.items():  # a fake would not run its class's code: that module is measured
        if overrides_torch_functions(tensor):
            raise CaptureError(
                f"{name!r} is a {type(tensor).__name__}, whose __torch_function__ runs its own code on every op",
                module=name.rpartition(".")[0],
            )
    derived = derived if derived is not None else {}
    derived_names = list(derived)
    # the flat input holding each derived size's source tensor (a tensor of the call)
    source_at = {name: _slot_of(size.source, leaves, slots) for name, size in derived.items()}
    shapes = shapes or {}  # sharded parameters of distributed engines: what this rank computes with
    with mode:
        fake_state = [
            torch.empty(tuple(shapes.get(id(t), t.shape)), dtype=t.dtype, device=_computing_device(t, leaves)).requires_grad_(t.requires_grad)
            for t in state.values()
        ]

    structure: list = []

    def run(*flat: torch.Tensor) -> list[torch.Tensor]:
        call_leaves = list(leaves)
        for i, tensor in zip(slots, flat):
            call_leaves[i] = _as_input(tensor.clone() if id(leaves[i]) in non_leaf else tensor, leaves[i])
        call_args, call_kwargs = pytree.tree_unflatten(call_leaves, tree)
        for (holder, steps, fake), tensor in zip(held, flat[len(slots) : len(slots) + len(held)]):
            put(holder, steps, _as_input(tensor.clone() if id(fake) in non_leaf else tensor, fake))
        given = len(slots) + len(held) + len(state)
        for name, symint in zip(derived_names, flat[given:]):
            derived[name] = TracedSize(symint, call_leaves[slots[source_at[name]]])
        flat = flat[:given]
        swapped = dict(zip(state, flat[len(slots) + len(held) :]))
        # the backward runs with the fakes swapped in too: a reentrant checkpoint's backward recomputes
        # its block and differentiates it there (gradients of the real parameters would be fakes)
        with torch.nn.utils.stateless._reparametrize_module(model, swapped, tie_weights=False, strict=False):
            out = model(*call_args, **call_kwargs)
            out_leaves, spec = pytree.tree_flatten(out)
            structure.extend([spec, [TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]])
            outputs = output_tensors(out)
            if backward:
                differentiated = backward_roots(out, outputs) if roots is None else [outputs[i] for i in roots]
                return outputs + run_backward(differentiated, list(flat))
            return outputs

    run._orig_mod = model  # make_fx records nn_module_stack relative to this root
    try:
        phases = tagging_recompute() if backward else contextlib.nullcontext()
        with size_oblivious(), no_stack_traces(), _layout_oblivious(), _access_paths_from_the_root(), \
                _attention_flags_as_bools(), _grouped_mm_any_float(), phases, user_tensors_read_only(mode), \
                _gradients_kept(model), mode:
            gm = make_fx(
                run, tracing_mode="symbolic", _allow_non_fake_inputs=True, record_module_stack=True
            )(*(leaves[i] for i in slots), *(fake for _, _, fake in held), *fake_state, *(derived[n].symint for n in derived_names))
        gm.meta["output_structure"] = tuple(structure)  # (pytree spec, leaves with TENSOR for tensors)
        return gm
    except CaptureError as exc:  # fxflops' own refusal inside the model's code: where it ran
        if exc.module is None and not isinstance(exc, OtherThreadError):  # that work cannot be measured either
            exc.module = _running_module(exc, model)
        raise
    except LayerCalledTwice:
        raise
    except Exception as exc:  # make_fx raises many types; name the model and the line
        hint, where = "", _running_module(exc, model)
        if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
            hint = (
                " — the code reads tensor values. If that is a module looping over the segments of a "
                "packed input (e.g. torch.split(x, lengths.tolist())), declare it with "
                f"per_segment={{{where or '<module path pattern>'!r}: '<offsets argument>'}}"
            )
        module = "" if where is None else f" in module {where or '<root>'!r}"
        raise CaptureError(
            f"could not trace {type(model).__name__} symbolically{module} at {_model_line(exc)}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0]}{hint}",
            module=where, in_trace=True,
        ) from exc


def _slot_of(tensor: torch.Tensor, leaves: list[Any], slots: list[int]) -> int:
    """The index among the traced tensor inputs of ``tensor``, one of the call's own tensors."""
    for k, i in enumerate(slots):
        if leaves[i] is tensor:
            return k
    raise CaptureError("a derived size's source tensor is not one of the call's tensor arguments")


def _computing_device(tensor: torch.Tensor, leaves: list[Any]) -> torch.device:
    """The device a parameter or buffer computes on: its own, or for a model built on the ``meta``
    device (planning without weights) the device of the call's first tensor that is not on meta."""
    if tensor.device.type != "meta":
        return tensor.device
    return next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"), tensor.device)


def _running_module(exc: BaseException, model: torch.nn.Module) -> str | None:
    """The path of the innermost module of ``model`` whose call was running where ``exc`` was
    raised (the ``self`` of the innermost traceback frame that is one of its modules), or None.
    Modules are known by their ``__dict__``: make_fx's module-stack tracer calls a child through a
    proxy object that shares it."""
    paths = {id(vars(module)): path for path, module in model.named_modules()}
    where, tb = None, exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(vars(owner)) in paths:
            where = paths[id(vars(owner))]
        tb = tb.tb_next
    return where


def _model_line(exc: BaseException) -> str:
    """The innermost frame of model code (not torch, not fxflops) in ``exc``'s traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not is_library_file(f.filename)]
    return format_location(frames[-1]) if frames else "an unknown line"


def op_name(target: Any) -> str:
    """An FX call target's short name: the overload packet's (``cumsum``), else the function's
    (``getitem``)."""
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", "")
