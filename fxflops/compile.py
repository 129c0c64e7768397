"""A ``torch.compile`` backend that counts the FLOPs of every graph Dynamo compiles.

``counter = fxflops.backend("inductor")`` wraps any registered backend: ``torch.compile(model,
backend=counter, dynamic=True)``. For each graph Dynamo hands over (one per graph break, one per
recompile) the counter

1. compiles it with the inner backend, unchanged, and returns that compiled callable wrapped;
2. builds the graph's FLOPs :class:`~fxflops.program.Program` by re-tracing it (an FX interpreter
   under ``make_fx``, node metadata preserved, so every op keeps its ``nn_module_stack``) — forward,
   and with ``backward=True`` the backward autograd runs from its outputs, with checkpointing's
   recompute tagged — in a ShapeEnv of its own whose symbols mirror Dynamo's: nothing is added to
   Dynamo's guards, so no recompilation comes from counting;
3. at every call reads the symbols' values from the arguments (Dynamo passes dynamic sizes as ints and
   tensors whose shapes carry the rest) and adds the monomials to ``counter.flops``, a
   :class:`~fxflops.meter.Meter`; the backward is counted with the forward when grad is enabled and
   the outputs require grad.

Symbols are named after Dynamo's sources where it can (``L['input_ids'].size()[1]`` ->
``input_ids_1``, as ``instrument()`` names them). Module paths drop Dynamo's ``L['self']`` root.
Counting never breaks compilation or the step: an error is warned about once and the graph's calls
are counted in ``counter.flops.uncounted``, unless ``strict=True``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx.experimental._config as fx_config
import torch.fx.traceback as fx_traceback
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic

from fxflops.binder import python_source
from fxflops.capture.graph import no_stack_traces
from fxflops.capture.phases import run_backward, tagging_recompute
from fxflops.capture.scope import capture_scope
from fxflops.capture.shape_env import BlamingShapeEnv
from fxflops.capture.symbols import guards_of, in_public_symbols, named_symbol
from fxflops.capture.trace import Captured
from fxflops.errors import CaptureError, FxFlopsError, warn
from fxflops.meter import Meter
from fxflops.analysis.paths import module_path
from fxflops.program import Program

_SIZE_SOURCE = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\]$")


def _public_name(symbol: sympy.Symbol, dynamo_env: Any) -> str:
    """``input_ids_1`` for a size Dynamo took from ``L['input_ids'].size()[1]``, else the symbol."""
    for source in (dynamo_env.var_to_sources.get(symbol, []) if dynamo_env is not None else []):
        match = _SIZE_SOURCE.match(source.name if isinstance(source.name, str) else source.name())
        if match:
            return f"{match.group(1)}_{match.group(2)}"
    return str(symbol)


def _example(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def capture_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], backward: bool) -> Captured:
    """Re-trace a Dynamo graph with symbols of our own mirroring Dynamo's (see module docstring).

    Scalar tensors among the inputs (Dynamo turns float module attributes such as an embedding's
    ``norm_type`` into 0-d tensor inputs read with ``.item()``) keep their example value."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = [_example(n) for n in placeholders]
    dynamo_symbols: dict[sympy.Symbol, int] = {}
    dynamo_env = None
    for value in examples:
        sizes = [value] if isinstance(value, torch.SymInt) else list(getattr(value, "shape", ()))
        for size in sizes:
            if isinstance(size, torch.SymInt):
                dynamo_env = size.node.shape_env
                for sym in size.node.expr.free_symbols:
                    dynamo_symbols[sym] = int(dynamo_env.backed_var_to_val.get(sym, size.node.hint))
    env = BlamingShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    ours: dict[sympy.Symbol, Any] = {}
    names: dict[sympy.Symbol, str] = {}
    for sym, hint in dynamo_symbols.items():
        name = _public_name(sym, dynamo_env)
        source = ConstantSource(name)
        created = env.create_symbol(hint, source, DimDynamic.DYNAMIC, positive=None, do_not_specialize_zero_one=True)
        ours[sym] = env.create_symintnode(created, hint=hint, source=source)
        names[created] = name

    variables = {sym: f"_{i}" for i, sym in enumerate(ours)}
    scope = {variables[sym]: symint for sym, symint in ours.items()}

    def mirror(size: Any) -> Any:
        """A Dynamo size as the same expression of our symbols (a SymInt, or an int)."""
        if not isinstance(size, torch.SymInt):
            return int(size)
        expr = size.node.expr
        if expr.is_Integer:
            return int(expr)
        return eval(python_source(expr, variables), {}, scope)  # noqa: S307 - our own printed arithmetic

    inputs: list[Any] = []
    with mode:
        for value, real in zip(examples, example_inputs):
            scalar = isinstance(real, torch.Tensor) and real.dim() == 0 and not real.requires_grad
            if scalar and not isinstance(real, torch._subclasses.FakeTensor):
                inputs.append(mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True))
            elif isinstance(value, torch.Tensor):
                fake = torch.empty([mirror(d) for d in value.shape], dtype=value.dtype, device=value.device)
                inputs.append(fake.requires_grad_(value.requires_grad))
            elif isinstance(value, torch.SymInt):
                inputs.append(mirror(value))
            else:
                inputs.append(value)

    def run(*args: Any) -> list[torch.Tensor]:
        with fx_traceback.preserve_node_meta():
            out = torch.fx.Interpreter(gm).run(*args)
        outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if backward:
            leaves = [a for a in args if isinstance(a, torch.Tensor)]
            return outputs + run_backward([t for t in outputs if t.dtype.is_floating_point], leaves)
        return outputs

    try:
        # outside Dynamo's tracing context, whose fake mode make_fx would otherwise adopt
        with capture_scope(), torch._guards.tracing(None), unset_fake_temporarily(), fx_config.patch(backed_size_oblivious=True), \
                no_stack_traces(), tagging_recompute(), mode:
            traced = make_fx(run, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*inputs)
    except Exception as exc:
        raise CaptureError(f"could not re-trace a compiled graph: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    env_to_named = {created: named_symbol(name) for created, name in names.items()}
    public = functools.partial(in_public_symbols, env, env_to_named)
    return Captured(
        graph_module=traced,
        shape_env=env,
        symbols={name: named_symbol(name) for created, name in names.items() if created not in env.replacements},
        env_to_named=env_to_named,
        guards=guards_of(env, env_to_named),
        input_dims={
            (f"args[{i}]",): (public(v) if isinstance(v, torch.SymInt) else tuple(public(d) for d in v.shape))
            for i, v in enumerate(inputs)
            if isinstance(v, (torch.Tensor, torch.SymInt))
        },
        placeholder_paths=[(f"args[{i}]",) for i in range(len(inputs))],  # every argument is a placeholder
    )


def _described(exc: Exception) -> str:
    return str(exc) if isinstance(exc, FxFlopsError) else f"internal error {type(exc).__name__}: {exc}"


def _graph_call(*args: Any) -> None:
    """The calling convention of a compiled graph: positional arguments only."""


class CountingBackend:
    """``fxflops.backend(inner)``: see the module docstring. ``flops`` is the Meter, ``programs`` one
    Program per compiled graph, ``graphs`` how many graphs were compiled."""

    def __init__(
        self, inner: str | Callable[..., Any], backward: bool, strict: bool, model: torch.nn.Module | None
    ) -> None:
        self.inner = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner
        self.backward = backward
        self.strict = strict
        self.model = model
        self._owner: dict[int, str] | None = None
        self.flops = Meter()
        self.programs: list[Any] = []
        self.graphs = 0
        self._warned: set[str] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = self.inner(gm, example_inputs)
        self.graphs += 1
        try:
            program = Program.from_capture(
                capture_graph(gm, example_inputs, self.backward), _graph_call, backward="traced" if self.backward else "none"
            )
        except Exception as exc:  # noqa: BLE001 - counting never breaks compilation (unless strict)
            if self.strict:
                raise
            self._warn(f"a compiled graph is not counted: {_described(exc)}")
            return self._uncounted(compiled)
        self.programs.append(program)
        return self._counting(compiled, program, self._anchor(gm, example_inputs))

    def _anchor(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> tuple[int, str] | None:
        """(argument index of a parameter, its module's path inside the graph): at run time the
        parameter's owner in ``model`` gives the path the graph's frame ran at. A graph compiled from a
        submodule's frame (after a graph break) names modules relative to that submodule, and Dynamo
        reuses it for every instance of the submodule."""
        if self.model is None:
            return None
        if self._owner is None:
            self._owner = {
                id(tensor): owner
                for owner, module in self.model.named_modules()
                for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False))
            }
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if id(value) in self._owner:
                user_paths = {module_path(u) for u in node.users}
                return i, (user_paths.pop() if len(user_paths) == 1 else "")
        return None

    def _counting(self, compiled: Callable[..., Any], program: Any, anchor: tuple[int, str] | None) -> Callable[..., Any]:
        meter, has_backward, owner = self.flops, self.backward, self._owner

        def prefix_of(args: tuple) -> str:
            if anchor is None:
                return ""
            full = owner.get(id(args[anchor[0]]), "")
            inside = anchor[1]
            if inside and full.endswith(inside):
                return full[: -len(inside)].rstrip(".")
            return full if not inside else ""

        def run(*args: Any) -> Any:
            out = compiled(*args)
            try:
                values = program.binder.values(args, {})
                if not program.within_guards(*values):
                    raise CaptureError(program.explain_guard_failure(values))
                training = has_backward and torch.is_grad_enabled() and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves(out)
                )
                meter.add(program, program.monomials(*values), training, prefix_of(args))
            except Exception as exc:  # noqa: BLE001 - counting never breaks the step (unless strict)
                if self.strict:
                    raise
                meter.not_counted()
                self._warn(f"a compiled call is not counted: {_described(exc)}")
            return out

        return run

    def _uncounted(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        meter = self.flops

        def run(*args: Any) -> Any:
            meter.not_counted()
            return compiled(*args)

        return run

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warn(f"fxflops: {message}", stacklevel=3)


def backend(
    inner: str | Any = "inductor",
    *,
    model: torch.nn.Module | None = None,
    backward: bool = True,
    strict: bool = False,
) -> CountingBackend:
    """A ``torch.compile`` backend counting every compiled graph's FLOPs into ``.flops`` (a Meter),
    wrapping the registered backend ``inner`` whose output it leaves unchanged; see the module
    docstring. Give the compiled ``model`` so that graphs compiled from a submodule's frame (after a
    graph break) are attributed to that submodule's path."""
    return CountingBackend(inner, backward, strict, model)
