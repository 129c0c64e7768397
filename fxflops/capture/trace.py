"""Capture: model + example call + named dims -> an FX graph whose sizes are named sympy symbols.

How (chosen by measurement, see TRACING-NOTES.md): our own ``FakeTensorMode`` over a
:class:`BlamingShapeEnv`, one symbol created per requested name (so equal example sizes never merge),
inputs built as fake tensors of those symbolic sizes (``capture/symbols.py``), then
``make_fx(tracing_mode="symbolic")`` with the module-stack tracer so every node knows its
``nn.Module`` path (``capture/graph.py``). Parameters stay real-shaped constants. No real compute
runs. ``backed_size_oblivious`` keeps size-1/size-0 examples from specialising. ``make_fx`` keeps
every tensor op, also one whose result is unused, so work that executes is counted.

A capture changes nothing of the user's: it runs without the user's saved-tensor hooks and modes
(``capture/ambient.py``), on a twin of the module tree and copies of the call's objects, with
what the model's code writes elsewhere put back (``capture/isolation.py``,
``capture/side_effects.py``), and neither consumes nor keeps Python's or numpy's random draws
(``capture/randomness.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree

from fxflops.capture.adapters import Adapter
from fxflops.capture.ambient import clean_slate, flags_context
from fxflops.capture.derived import DerivedSize, TracedSize
from fxflops.capture.engines import compute_shapes, engines_left_alone
from fxflops.capture.fake_mode import ThreadBoundFakeMode
from fxflops.capture.graph import trace_graph
from fxflops.capture.inputs import DimSpec, Path, bind_call, held_ints, is_metadata, path_label, resolve_dims, tensor_leaves
from fxflops.capture.isolation import isolated_call, preserving_state, twin_of
from fxflops.capture.lifting import Lifted, install_stand_ins, lifted_paths
from fxflops.capture.randomness import RandomDraw, refusing_random_draws
from fxflops.capture.reads import Reads, argument_functions, recording_reads
from fxflops.capture.reuse import LayerCalledTwice, Reuse, reusing_repeated_layers
from fxflops.capture.scope import capture_scope
from fxflops.capture.shape_env import BlamingShapeEnv
from fxflops.capture.side_effects import Reach, WorkTest, reach_of, undoing_side_effects
from fxflops.capture.symbols import (
    Guard, check_free, guards_of, held_inputs, held_paths, in_public_symbols, named_symbol, named_symint, symbolic_inputs,
    symbolic_ints,
)
from fxflops.errors import CaptureError, InputError

__all__ = ["Captured", "Guard", "capture", "named_symbol"]


@dataclass
class Captured:
    """The result of one capture: graph, named symbols, guards and how inputs map to symbols."""

    graph_module: torch.fx.GraphModule
    shape_env: BlamingShapeEnv
    symbols: dict[str, sympy.Symbol]  # free names (not pinned by the code) -> public symbols
    env_to_named: dict[sympy.Symbol, sympy.Symbol]  # ShapeEnv's s<k> -> public symbol
    guards: list[Guard]
    input_dims: dict[Path, tuple[sympy.Expr, ...]]  # every tensor input's dims, in public symbols
    placeholder_paths: list[Path]  # the input path of each tensor placeholder, in graph order
    lifted: dict[str, Lifted] = field(default_factory=dict)  # per-segment modules by path
    reused: dict[str, str] = field(default_factory=dict)  # layer path -> the traced layer it repeats
    reads: Reads = field(default_factory=Reads)  # model attributes the trace read (capture/reads.py)
    copies: dict[str, str] = field(default_factory=dict)  # module path -> the traced module it is billed as
    derived: dict[sympy.Symbol, DerivedSize] = field(default_factory=dict)  # sizes the binder computes from metadata values
    grad: bool = True  # grad mode the trace ran in
    symbolic_arguments: frozenset[str] = frozenset()  # Python int arguments traced as symbols (capture/adapters.py)
    assumptions_at_capture: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.assumptions_at_capture = self.assumptions()

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
        return in_public_symbols(self.shape_env, self.env_to_named, expr)


@dataclass
class _Trace:
    """One successful symbolic trace of the call, before it is put in public symbols."""

    graph_module: torch.fx.GraphModule
    env: BlamingShapeEnv
    env_syms: dict[str, sympy.Symbol]
    fakes: dict[Path, torch.Tensor]
    symints: dict[Path, Any]
    lifted: dict[str, Lifted]
    reuse: Reuse


@contextlib.contextmanager
def _attaching(reads: Reads) -> Iterator[None]:
    """A failing capture's exception carries what it read (``fxflops_reads``: reads, copies, grad
    mode), so that a refusal can be kept for the model state it failed in."""
    try:
        yield
    except Exception as exc:
        exc.fxflops_reads = (reads, {}, torch.is_grad_enabled())
        raise


def _trace_once(
    model: torch.nn.Module, call: tuple[tuple, dict], tensors: dict[Path, torch.Tensor], integers: dict[Path, int],
    specs: list[DimSpec], reusing: bool, backward: bool, adapter: Adapter, per_segment: dict[str, str], reads: Reads,
    shapes: dict[int, torch.Size], roots: tuple[int, ...] | None, derived: dict[str, tuple[Path, int]], reach: Reach,
    integer_names: dict[Path, str],
) -> _Trace:
    """The call traced with ``specs`` free (and repeated layers reused when ``reusing``); ``derived``:
    the derived sizes' example values, each a symbol the adapter's stand-ins receive; ``reach``:
    what the model's code can write to (``capture/side_effects.py``)."""
    env = BlamingShapeEnv()
    mode = ThreadBoundFakeMode(shape_env=env, allow_non_fake_inputs=True)
    fakes, env_syms = symbolic_inputs(env, mode, tensors, specs)
    symints = symbolic_ints(env, integers, env_syms, integer_names)
    sizes = {
        name: TracedSize(named_symint(env, name, example, env_syms), fakes[source])
        for name, (source, example) in derived.items()
    }
    fake_by_id = {id(tensors[path]): fake for path, fake in fakes.items()}
    args, kwargs = pytree.tree_map(lambda v: fake_by_id.get(id(v), v) if isinstance(v, torch.Tensor) else v, call)
    args, kwargs = with_arguments(model.forward, args, kwargs, {path[0]: s for path, s in symints.items() if len(path) == 1})
    held = held_inputs(bind_call(model.forward, args, kwargs), {**fakes, **symints})
    non_leaf = frozenset(id(fakes[path]) for path, t in tensors.items() if t.requires_grad and not t.is_leaf)
    twin = twin_of(model)  # the trace runs on, and writes to, its own copy of the module tree
    tree, ignored = twin.model, adapter.same_layer_attributes
    with refusing_random_draws(tree, reach), engines_left_alone(tree), adapter.capturing(tree, sizes), \
            install_stand_ins(tree, per_segment, backward, ignored, shapes) as lifted:
        skip = set(lifted_paths(tree, per_segment))
        # reads recorded around the trace only: fxflops' own walks over the modules (an adapter
        # looking for feature getters) are not the model's code and guard nothing
        with reusing_repeated_layers(tree, skip, backward, reusing, ignored) as reuse, recording_reads(tree, reads, twin.originals):
            gm = trace_graph(tree, mode, args, kwargs, backward, held, non_leaf, shapes, roots, sizes)
    mode.check()
    return _Trace(gm, env, env_syms, fakes, symints, lifted, reuse)


def _trace(
    model: torch.nn.Module, call: tuple[tuple, dict], tensors: dict[Path, torch.Tensor], integers: dict[Path, int],
    specs: list[DimSpec], size_one: list[DimSpec], positional: list[str], floating_work: WorkTest | None, **options: Any,
) -> tuple[_Trace, list[DimSpec]]:
    """Trace, again without layer reuse when a layer runs twice (``capture/reuse.py``), and again
    with the ``size_one`` dims constant when the trace fails with them free (a ``(4, 1)`` bias must
    broadcast). Returns the trace and the specs it kept free. Each attempt traces its own copy of
    the call's opaque arguments (``positional``: the names of the positional ones), and what it
    wrote to the model's objects and outside them (``capture/side_effects.py``) is put back after
    it: a failed attempt's writes (a key-value cache it filled) never reach the next one, nor the
    user's objects. An attempt that drew random numbers is not repeated (``capture/randomness.py``)."""
    plans, reach = [(specs, True)], None
    while True:
        specs, reusing = plans.pop(0)
        own_args, own_kwargs, uncopied = isolated_call(*call, positional)
        if reach is None:  # after the arguments were found traceable (an iterator is refused at once)
            reach = reach_of(model)
        try:
            with preserving_state(model, uncopied), undoing_side_effects(reach, options["reads"], floating_work):
                return _trace_once(model, (own_args, own_kwargs), tensors, integers, specs, reusing, reach=reach, **options), specs
        except LayerCalledTwice:
            plans.append((specs, False))
        except RandomDraw:
            raise
        except CaptureError:
            if not size_one:
                raise
            plans.append(([spec for spec in specs if spec not in size_one], reusing))
            size_one = []


@clean_slate()  # none of the user's saved-tensor hooks or modes around the call sees the capture (capture/ambient.py)
def capture(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    dims: dict[str, dict[int, str]] | None = None,
    allow_pins: bool = False,
    per_segment: dict[str, str] | None = None,
    backward: bool = False,
    adapter: Adapter | None = None,
    roots: tuple[int, ...] | None = None,
    floating_work: WorkTest | None = None,
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
    holds its capture context. ``roots``: the output tensors (by position) the backward starts from,
    when not the loss or every floating output (``capture/graph.py``). ``floating_work(func, args,
    kwargs, out)``: whether an op does work some convention counts (the rules' own test, which this
    stage does not import; None: every op), asked of the ops a memoizing function runs
    (``capture/side_effects.py``).
    """
    kwargs = kwargs or {}
    adapter = adapter or Adapter()
    named = bind_call(model.forward, args, kwargs)
    symbolic = symbolic_arguments(named, dims, adapter)
    # tensor dims as named; dims naming integer arguments only: every tensor dim free as with dims=None
    dims = {label: spec for label, spec in (dims or {}).items() if not isinstance(spec, str)} or None
    if dims is None and (named_dims := adapter.dims(args, kwargs)) is not None:
        dims, allow_pins = named_dims, True
    per_segment = {**adapter.per_segment, **(per_segment or {})}
    tensors = tensor_leaves(named)
    derived = {size.name: size for size in adapter.derived_sizes(args, kwargs)}
    for size in derived.values():
        if size.source not in tensors:
            raise CaptureError(f"derived size {size.name!r} needs input {path_label(size.source)!r}, which the call lacks")
    specs = resolve_dims(dims, tensors)
    size_one = [  # with dims=None, automatic size-1 dims (not metadata rows: sequences, images, never pinned)
        spec for spec in specs
        if tensors[spec.path].shape[spec.dim] == 1 and not (spec.dim == 0 and is_metadata(tensors[spec.path]))
    ] if dims is None else []
    # the graph's inputs: the call's tensors and symbolic integers in call order (capture/graph.py)
    slots = {name: _Slot((name,)) for name in symbolic}
    leaves = pytree.tree_leaves(with_arguments(model.forward, args, kwargs, slots))
    reads = Reads(functions=argument_functions(named))

    def traced() -> tuple[_Trace, list[DimSpec]]:
        with capture_scope(), _attaching(reads):
            return _trace(
                model, (args, kwargs), tensors, held_ints(named) | {(name,): named[name] for name in symbolic}, specs, size_one, list(named)[: len(args)],
                floating_work,
                backward=backward, adapter=adapter, per_segment=per_segment, reads=reads, roots=roots,
                shapes=compute_shapes(model),  # sharded parameters: what this rank computes with
                derived={name: (size.source, size.value(tensors[size.source])) for name, size in derived.items()},
                integer_names={(name,): symbol for name, symbol in symbolic.items()},
            )

    # in a context of its own (the capture scope's own state set inside it) holding the caller's flags
    # only: context variables of a call the capture runs inside (HF's output collectors, which the
    # twin's forward hooks append to) never see the trace's fake tensors (capture/ambient.py)
    trace, specs = flags_context().run(traced)
    pinned = check_free(trace.env, trace.env_syms, strict=dims is not None and not allow_pins)
    env_to_named = {sym: named_symbol(name) for name, sym in trace.env_syms.items()}
    public = functools.partial(in_public_symbols, trace.env, env_to_named)
    # a derived size the trace fixed (an example of one patch) stays a symbol the binder computes, and
    # the program holds only for calls with that value: a guard
    fixed = [
        Guard(sympy.Eq(named_symbol(name), public(pinned[name])), f"derived size {name} fixed by the traced code")
        for name in sorted(set(pinned) & set(derived))
    ] + [
        # unevaluated: sympy would call it True for a positive symbol, and a derived size can be 0
        Guard(sympy.Ge(named_symbol(name), size.minimum, evaluate=False), f"derived size {name}: the adapter's stand-ins need at least {size.minimum}")
        for name, size in sorted(derived.items()) if size.minimum > 0
    ] + [
        Guard(sympy.Ge(named_symbol(symbol), 0, evaluate=False), f"integer argument {name} traced as a size")
        for name, symbol in symbolic.items() if named[name] >= 0 and symbol not in pinned
    ]
    path_of = {id(tensor): path for path, tensor in tensors.items()}
    return Captured(
        graph_module=trace.graph_module,
        shape_env=trace.env,
        symbols={name: named_symbol(name) for name in trace.env_syms if name not in pinned or name in derived},
        env_to_named=env_to_named,
        guards=guards_of(trace.env, env_to_named) + fixed,
        input_dims={path: tuple(public(size) for size in fake.shape) for path, fake in trace.fakes.items()}
        | {path: public(symint.node.expr) for path, symint in trace.symints.items()},
        placeholder_paths=[
            *(leaf.path if isinstance(leaf, _Slot) else path_of[id(leaf)] for leaf in leaves if isinstance(leaf, (torch.Tensor, _Slot))),
            *held_paths({**trace.fakes, **trace.symints}),
        ],
        lifted=trace.lifted,
        reused=trace.reuse.templates,
        reads=reads,
        copies={**trace.reuse.templates, **{path: l.path for path, l in trace.lifted.items() if l.path != path}},
        derived={named_symbol(name): size for name, size in derived.items()},
        grad=torch.is_grad_enabled(),
        symbolic_arguments=frozenset(symbolic),
    )


@dataclass(frozen=True)
class _Slot:
    """Where a symbolic integer argument sits among the call's leaves."""

    path: Path


def symbolic_arguments(named: dict[str, Any], dims: dict[str, Any] | None, adapter: Adapter) -> dict[str, str]:
    """The call's Python int arguments traced as symbols, with their symbol names: those ``dims``
    names with a string (``dims={"keep": "keep"}``) and the adapter's (named after the argument).
    Such an argument given another value (a float, a tensor, ``None``) is part of the call's
    identity as any value is. A string in ``dims`` for a name the call lacks raises :class:`InputError`."""
    chosen = {name: name for name in adapter.symbolic_arguments if type(named.get(name)) is int}
    for name, spec in (dims or {}).items():
        if isinstance(spec, str):
            if name not in named:
                raise InputError(f"dims[{name!r}] is a symbol name for a Python int argument, but the call has no argument {name!r}: it has {sorted(named)}")
            if not spec.isidentifier():
                raise InputError(f"symbol name {spec!r} for argument {name!r} must be an identifier")
            if type(named[name]) is int:
                chosen[name] = spec
    return chosen


def with_arguments(forward: Any, args: tuple, kwargs: dict, values: dict[str, Any]) -> tuple[tuple, dict]:
    """The call with the arguments named in ``values`` (positional or keyword) replaced by them."""
    if not values:
        return args, kwargs
    names = list(bind_call(forward, args, kwargs))[: len(args)]
    return (
        tuple(values.get(name, arg) for name, arg in zip(names, args)) + args[len(names) :],
        {key: values.get(key, value) for key, value in kwargs.items()},
    )
