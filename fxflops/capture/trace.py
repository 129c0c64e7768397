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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic

from fxflops.capture.adapters import Adapter
from fxflops.capture.engines import engines_left_alone
from fxflops.capture.graph import trace_graph
from fxflops.capture.inputs import (
    DimSpec, Path, bind_call, held_ints, held_root, is_metadata, path_label, reach, resolve_dims, tensor_leaves,
)
from fxflops.capture.isolation import isolated_call, preserving_state
from fxflops.capture.lifting import Lifted, install_stand_ins, lifted_paths
from fxflops.capture.reads import Reads, recording_reads
from fxflops.capture.reuse import LayerCalledTwice, reusing_repeated_layers
from fxflops.capture.scope import capture_scope
from fxflops.capture.shape_env import BlamingShapeEnv, format_location
from fxflops.errors import CaptureError, InputError, PinnedSymbolError


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
