"""Capture: model + example call + named dims -> an FX graph whose sizes are named sympy symbols.

How (chosen by measurement, see TRACING-NOTES.md): our own ``FakeTensorMode`` over a
:class:`BlamingShapeEnv`, one symbol created per requested name (so equal example sizes never merge),
inputs built as fake tensors of those symbolic sizes, then ``make_fx(tracing_mode="symbolic")`` with the
module-stack tracer so every node knows its ``nn.Module`` path. Parameters stay real-shaped constants.
No real compute runs. ``backed_size_oblivious`` keeps size-1/size-0 examples from specialising.
``make_fx`` keeps every tensor op, also one whose result is unused, so work that executes is counted.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic

from fxflops.capture.adapters import Adapter
from fxflops.capture.lifting import Lifted, install_stand_ins, lifted_paths
from fxflops.capture.reuse import LayerCalledTwice, reusing_repeated_layers
from fxflops.capture.phases import run_backward, tagging_recompute
from fxflops.capture.inputs import (
    DimSpec, Path, bind_call, held_ints, held_root, is_metadata, path_label, put, reach, resolve_dims, tensor_leaves,
)
from fxflops.capture.engines import compute_shapes, engines_left_alone
from fxflops.capture.isolation import isolated_call, preserving_state
from fxflops.capture.reads import Reads, recording_reads
from fxflops.capture.scope import capture_scope, patched
from fxflops.capture.shape_env import BlamingShapeEnv, format_location, is_library_file
from fxflops.errors import CaptureError, InputError, PinnedSymbolError


TENSOR = object()  # marks tensor leaves in a graph's recorded output structure


def named_symbol(name: str) -> sympy.Symbol:
    """The public symbol for a size called ``name``: a positive integer."""
    return sympy.Symbol(name, integer=True, positive=True)


@dataclass(frozen=True)
class Guard:
    """A condition on the symbols that the trace relied on, and the model line that made it."""

    expr: sympy.Basic
    location: str

    def __str__(self) -> str:
        return f"{self.expr}  ({self.location})"


@dataclass
class Captured:
    """The result of one capture: graph, named symbols, guards and how inputs map to symbols."""

    graph_module: torch.fx.GraphModule
    shape_env: BlamingShapeEnv
    symbols: dict[str, sympy.Symbol]  # free names (not pinned by the code) -> public symbols
    env_to_named: dict[sympy.Symbol, sympy.Symbol]  # ShapeEnv's s<k> -> public symbol
    dim_specs: list[DimSpec]
    guards: list[Guard]
    input_dims: dict[Path, tuple[sympy.Expr, ...]]  # every tensor input's dims, in public symbols
    placeholder_paths: list[Path]  # the input path of each tensor placeholder, in graph order
    pinned: dict[str, sympy.Expr] = field(default_factory=dict)  # auto dims the code fixed
    lifted: dict[str, Lifted] = field(default_factory=dict)  # per-segment modules by path
    reused: dict[str, str] = field(default_factory=dict)  # layer path -> the traced layer it repeats
    assumptions_at_capture: tuple[int, int] = (0, 0)
    reads: Reads = field(default_factory=Reads)  # model attributes the trace read (capture/reads.py)
    copies: dict[str, str] = field(default_factory=dict)  # module path -> the traced module it is billed as
    grad: bool = True  # grad mode the trace ran in

    def constants(self) -> set[int]:
        """Ids of the real tensors the trace used as constants (``make_fx`` keeps each as a
        ``get_attr`` of its graph; lifted modules' graphs included): their shapes are the trace's."""
        graphs = [self.graph_module, *(lifted.graph_module for lifted in self.lifted.values())]
        return {
            id(getattr(gm, node.target))
            for gm in graphs
            for node in gm.graph.nodes
            if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor)
        }

    def assumptions(self) -> tuple[int, int]:
        """(guards, replacements) in the ShapeEnv: must not grow after capture, or sizes specialised."""
        return len(self.shape_env.guards), len(self.shape_env.replacements)

    def named(self, expr: Any) -> sympy.Expr:
        """A ShapeEnv expression (SymInt or sympy) in the public symbols, replacements applied."""
        if isinstance(expr, torch.SymInt):
            expr = expr.node.expr
        return self.shape_env.replace(sympy.sympify(expr)).xreplace(self.env_to_named)


def _symbolic_inputs(
    env: BlamingShapeEnv,
    mode: FakeTensorMode,
    tensors: dict[Path, torch.Tensor],
    specs: list[DimSpec],
) -> tuple[dict[Path, torch.Tensor], dict[str, sympy.Symbol]]:
    """Fake tensors for ``tensors`` whose spec'd dims are SymInts (one symbol per distinct name)."""
    by_name: dict[str, tuple[Any, int]] = {}
    sizes: dict[Path, list[Any]] = {path: list(t.shape) for path, t in tensors.items()}
    for spec in specs:
        example = tensors[spec.path].shape[spec.dim]
        if spec.name not in by_name:
            source = ConstantSource(spec.name)
            sym = env.create_symbol(
                example, source, DimDynamic.DYNAMIC, positive=None, do_not_specialize_zero_one=True
            )
            by_name[spec.name] = (env.create_symintnode(sym, hint=example, source=source), example)
        symint, first = by_name[spec.name]
        if example != first:
            raise InputError(
                f"symbol {spec.name!r} names sizes {first} and {example} in the example call; "
                "one symbol must have one value"
            )
        sizes[spec.path][spec.dim] = symint
    fakes = {}
    with mode:
        for path, tensor in tensors.items():
            fake = torch.empty(sizes[path], dtype=tensor.dtype, device=tensor.device)
            if tensor.requires_grad:
                fake.requires_grad_(True)
            fakes[path] = fake
    env_syms = {name: symint.node.expr for name, (symint, _) in by_name.items()}
    return fakes, env_syms


def _symbolic_ints(env: BlamingShapeEnv, integers: dict[Path, int], env_syms: dict[str, sympy.Symbol]) -> dict[Path, Any]:
    """A SymInt for every integer an argument object holds, named after its path (added to ``env_syms``)."""
    symints = {}
    for path, example in integers.items():
        name = path_label(path)
        source = ConstantSource(name)
        sym = env.create_symbol(example, source, DimDynamic.DYNAMIC, positive=None, do_not_specialize_zero_one=True)
        symints[path] = env.create_symintnode(sym, hint=example, source=source)
        env_syms[name] = sym
    return symints


def _check_free(env: BlamingShapeEnv, env_syms: dict[str, sympy.Symbol], strict: bool) -> dict:
    """Raise if the model pinned or merged a requested symbol (``strict``), else report the pins."""
    pinned = {}
    for name, sym in env_syms.items():
        target = env.replacements.get(sym)
        vr = env.var_to_range.get(sym)
        if target is None and vr is not None and vr.is_singleton():
            target = sympy.Integer(int(vr.lower))
        if target is None:
            continue
        pinned[name] = target
        if strict:
            where = format_location(
                getattr(env.replacements_slocs.get(sym), "framework_loc", None)
            )
            what = (
                f"fixed to {target}"
                if not target.free_symbols
                else f"tied to {target.xreplace({s: sympy.Symbol(n) for n, s in env_syms.items()})}"
            )
            raise PinnedSymbolError(
                f"symbol {name!r} is not free: the model code {what} at {where}. "
                f"Remove {name!r} from dims, or change the code so the size can vary."
            )
    return pinned


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Skip per-node Python stack traces: ~20% of capture time, and fxflops reports module paths."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


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
        linear = stack.enter_context(patched(F, "linear", lambda input, weight, bias=None: linear(
            input.clone(memory_format=torch.contiguous_format), weight, bias
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

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        return sdpa(query, key, value, attn_mask, dropout_p, bool(is_causal), **kwargs)

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


def trace_graph(
    model: torch.nn.Module,
    mode: FakeTensorMode,
    args: tuple,
    kwargs: dict,
    backward: bool = False,
    held: list[tuple[Any, Path, Any]] = (),
    non_leaf: frozenset[int] = frozenset(),
) -> torch.fx.GraphModule:
    """``make_fx`` of ``model(*args, **kwargs)`` whose tensors are fakes of ``mode``; with
    ``backward``, also of the backward from its loss or outputs (``_backward_roots``; ``capture/phases.py``).
    ``held`` are the tensors and integers held by argument objects, as (the object, the steps to the
    value below it, its fake or SymInt): graph inputs after the call's own tensors, put into the
    objects when the trace runs. ``non_leaf``: ids of input fakes standing for tensors that are not
    leaves of autograd (``x.clone()`` of a leaf that requires grad): they enter the model as such,
    a copy made inside the trace, so in-place ops that a leaf requiring grad refuses work as on the
    real tensor (the copy moves data, no FLOPs).

    Parameters and buffers enter as static-shaped fake placeholders, swapped in with
    ``functional_call``: the model's real state is never read for compute nor mutated (e.g.
    BatchNorm's ``num_batches_tracked += 1``). A distributed engine's sharded parameters get the
    shape this rank computes with (``capture/engines.py``); a model on the ``meta`` device (no
    weights) has its parameters faked on the call's device. Nodes carry ``nn_module_stack`` relative to ``model``;
    ``gm.meta["output_structure"]`` keeps the output's pytree spec and its non-tensor leaves.
    """
    leaves, tree = pytree.tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    shapes = compute_shapes(model)  # sharded parameters of distributed engines: what this rank computes with
    with mode:
        fake_state = [
            torch.empty(tuple(shapes.get(id(t), t.shape)), dtype=t.dtype, device=_computing_device(t, leaves)).requires_grad_(t.requires_grad)
            for t in state.values()
        ]

    structure: list = []

    def run(*flat: torch.Tensor) -> list[torch.Tensor]:
        call_leaves = list(leaves)
        for i, tensor in zip(slots, flat):
            call_leaves[i] = tensor.clone() if id(leaves[i]) in non_leaf else tensor
        call_args, call_kwargs = pytree.tree_unflatten(call_leaves, tree)
        for (holder, steps, fake), tensor in zip(held, flat[len(slots) : len(slots) + len(held)]):
            put(holder, steps, tensor.clone() if id(fake) in non_leaf else tensor)
        swapped = dict(zip(state, flat[len(slots) + len(held) :]))
        out = torch.func.functional_call(model, swapped, call_args, call_kwargs, tie_weights=False, strict=False)
        out_leaves, spec = pytree.tree_flatten(out)
        structure.extend([spec, [TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]])
        outputs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        if backward:
            return outputs + run_backward(_backward_roots(out, outputs), list(flat))
        return outputs

    run._orig_mod = model  # make_fx records nn_module_stack relative to this root
    try:
        phases = tagging_recompute() if backward else contextlib.nullcontext()
        with fx_config.patch(backed_size_oblivious=True), _no_stack_traces(), _layout_oblivious(), _attention_flags_as_bools(), _grouped_mm_any_float(), phases, mode:
            gm = make_fx(
                run, tracing_mode="symbolic", _allow_non_fake_inputs=True, record_module_stack=True
            )(*(leaves[i] for i in slots), *(fake for _, _, fake in held), *fake_state)
        gm.meta["output_structure"] = tuple(structure)  # (pytree spec, leaves with TENSOR for tensors)
        return gm
    except (CaptureError, LayerCalledTwice):
        raise
    except Exception as exc:  # make_fx raises many types; name the model and the line
        hint = ""
        if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
            hint = (
                " — the code reads tensor values. If that is a module looping over the segments of a "
                "packed input (e.g. torch.split(x, lengths.tolist())), declare it with "
                "per_segment={'<module path pattern>': '<offsets argument>'}"
            )
        raise CaptureError(
            f"could not trace {type(model).__name__} symbolically at {_model_line(exc)}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0]}{hint}"
        ) from exc


def _computing_device(tensor: torch.Tensor, leaves: list[Any]) -> torch.device:
    """The device a parameter or buffer computes on: its own, or for a model built on the ``meta``
    device (planning without weights) the device of the call's first tensor that is not on meta."""
    if tensor.device.type != "meta":
        return tensor.device
    return next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"), tensor.device)


def held_paths(tensors: dict[Path, Any]) -> list[Path]:
    """The paths of the tensors held by argument objects, in input order."""
    return [path for path in tensors if held_root(path) is not None]


def _held_inputs(named: dict[str, Any], fakes: dict[Path, torch.Tensor]) -> list[tuple[Any, Path, torch.Tensor]]:
    """(the object in the trace's own copy of the call, the steps below it, the fake) for every tensor
    an argument object holds (see :func:`trace_graph`)."""
    held = []
    for path in held_paths(fakes):
        root = held_root(path)
        held.append((reach(named[path[0]], path[1 : root + 1]), path[root + 1 :], fakes[path]))
    return held


def _backward_roots(out: Any, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What training differentiates: the ``loss`` of an output that has one (a Hugging Face
    ``ModelOutput``, a dict), as ``out.loss.backward()`` does; else every floating-point output
    (``loss = sum of the outputs``). Other outputs of a model with a loss (LLaVA returns the vision
    tower's last hidden state, which its projector does not read) get no gradient in training."""
    loss = out.get("loss") if isinstance(out, Mapping) else None
    if isinstance(loss, torch.Tensor) and loss.dtype.is_floating_point:
        return [loss]
    return [x for x in outputs if x.dtype.is_floating_point]


def _model_line(exc: BaseException) -> str:
    """The innermost frame of model code (not torch, not fxflops) in ``exc``'s traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not is_library_file(f.filename)]
    return format_location(frames[-1]) if frames else "an unknown line"


@contextlib.contextmanager
def _attaching(reads: Reads) -> Iterator[None]:
    """A failing capture's exception carries what it read (``fxflops_reads``: reads, copies, grad
    mode), so that a refusal can be kept for the model state it failed in."""
    try:
        yield
    except Exception as exc:
        exc.fxflops_reads = (reads, {}, torch.is_grad_enabled())
        raise


def capture(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    dims: dict[str, dict[int, str]] | None = None,
    allow_pins: bool = False,
    per_segment: dict[str, str] | None = None,
    backward: bool = False,
    adapter: Adapter | None = None,
) -> Captured:
    """Trace ``model(*args, **kwargs)`` once with the ``dims`` as free symbols (see module doc).

    A requested symbol the code pins raises :class:`PinnedSymbolError` unless ``dims`` is ``None``
    (every dim free unless pinned, like ``Dim.AUTO``; when the trace fails with them free, the
    example's size-1 dims are traced as constants: they broadcast) or ``allow_pins`` (a re-capture for a call
    outside an earlier program's guards: the pin becomes a guard of the new branch).
    ``per_segment`` lifts modules whose work is per segment (see ``capture/lifting.py``).
    ``backward`` captures the joint forward+backward graph (see ``capture/phases.py``).
    ``adapter`` (``capture/adapters.py``; the call is already prepared by it) names the dims when
    ``dims`` is ``None`` (pins allowed, as for automatic names), adds its per-segment modules and
    holds its capture context.
    """
    kwargs = kwargs or {}
    adapter = adapter or Adapter()
    if dims is None and (named_dims := adapter.dims(args, kwargs)) is not None:
        dims, allow_pins = named_dims, True
    per_segment = {**adapter.per_segment, **(per_segment or {})}
    named = bind_call(model.forward, args, kwargs)
    tensors = tensor_leaves(named)
    specs = resolve_dims(dims, tensors)
    integers = held_ints(named)

    leaves = pytree.tree_leaves((args, kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    with capture_scope():
        own_args, own_kwargs, uncopied = isolated_call(args, kwargs)
        with preserving_state(model, uncopied), engines_left_alone(model), recording_reads(model) as reads, _attaching(reads):
            # without reuse when a layer runs twice (capture/reuse.py); with dims=None, automatic size-1
            # dims become constants when the trace fails with them free (a (4, 1) bias must broadcast)
            size_one = [  # not metadata rows (sequences, images: never pinned)
                spec for spec in specs
                if tensors[spec.path].shape[spec.dim] == 1 and not (spec.dim == 0 and is_metadata(tensors[spec.path]))
            ] if dims is None else []
            plans = [(specs, True)]
            while plans:
                specs, reusing = plans.pop(0)
                env = BlamingShapeEnv()
                mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
                fakes, env_syms = _symbolic_inputs(env, mode, tensors, specs)
                symints = _symbolic_ints(env, integers, env_syms)
                fake_by_id = {id(tensors[path]): fake for path, fake in fakes.items()}
                call_args, call_kwargs = pytree.tree_map(
                    lambda v: fake_by_id.get(id(v), v) if isinstance(v, torch.Tensor) else v, (own_args, own_kwargs)
                )
                held = _held_inputs(bind_call(model.forward, call_args, call_kwargs), {**fakes, **symints})
                non_leaf = frozenset(id(fakes[path]) for path, t in tensors.items() if t.requires_grad and not t.is_leaf)
                try:
                    with adapter.capturing(), install_stand_ins(model, per_segment, backward, adapter.same_layer_attributes) as lifted:
                        skip = set(lifted_paths(model, per_segment))
                        with reusing_repeated_layers(model, skip, backward, reusing, adapter.same_layer_attributes) as reuse:
                            gm = trace_graph(model, mode, call_args, call_kwargs, backward, held, non_leaf)
                except LayerCalledTwice:
                    plans.append((specs, False))
                except CaptureError:
                    if not size_one:
                        raise
                    plans.append(([spec for spec in specs if spec not in size_one], reusing))
                    size_one = []
    pinned = _check_free(env, env_syms, strict=dims is not None and not allow_pins)
    env_to_named = {sym: named_symbol(name) for name, sym in env_syms.items()}
    path_of = {id(tensor): path for path, tensor in tensors.items()}
    copies = {**reuse.templates, **{path: l.path for path, l in lifted.items() if l.path != path}}
    captured = Captured(
        gm, env, {}, env_to_named, specs, [], {}, [*(path_of[id(leaves[i])] for i in slots), *held_paths({**fakes, **symints})], pinned, lifted, reuse.templates,
        reads=reads, copies=copies, grad=torch.is_grad_enabled(),
    )
    captured.symbols = {name: named_symbol(name) for name in env_syms if name not in pinned}
    captured.input_dims = {
        path: tuple(captured.named(size) for size in fake.shape) for path, fake in fakes.items()
    } | {path: captured.named(symint.node.expr) for path, symint in symints.items()}
    for guard in env.guards:
        expr = captured.named(guard.expr)
        if expr is not sympy.true:
            captured.guards.append(Guard(expr, format_location(guard.sloc.framework_loc)))
    captured.assumptions_at_capture = captured.assumptions()
    return captured
