"""Measured islands: a call whose capture failed inside one module, counted exactly all the same.

When the symbolic capture of a call fails in a module's own code (a loop over ``image_sizes``, a
slice whose bounds are tensor values, ``if mask.any():``), :class:`~fxflops.errors.CaptureError`
names that module (``CaptureError.module``). Only that module's *own* code cannot be traced: its
children (a vision tower, a projector, the language model) usually can. So the call's situation is
counted as a :class:`Spine`: the failing module and its ancestors are the *spine*, whose own ops
(the code in their ``forward`` outside any child) are measured per call, and every child of a spine
module that is not on the spine is counted as its own symbolic program, captured from the call it
gets (an internal :class:`~fxflops.instrument.Instrumented` per child, meter shared, at the child's
path). A child whose own capture fails inside joins the spine (its failing module and the modules
between): the measured set is the smallest the captures allow.

One measured call (:class:`MeasuredCall`), in the calling thread only:

- the spine modules and their children are routed for the call (an instance-level ``_call_impl``
  that dispatches on the thread, as ``generation.py`` routes ``generate``'s forwards; another thread
  runs them unchanged; removed when the call returns or raises);
- while a spine module's own code runs, :class:`OwnOps`, a dispatch mode, applies fxflops' rules to
  each op's concrete shapes (the shapes of device tensors are host data in eager mode: no sync);
  while a child runs the mode is popped, so the child's ops run at full speed;
- a child is looked up (or captured) before it runs, then run on the call its adapter prepared;
- with a backward to follow (training), which outputs of each child the loss reaches is read from
  the autograd graph when the call returns (from the loss, or every floating output, as a capture
  differentiates, through the spine's own autograd nodes, jumping across each child from its outputs
  to its inputs): each child's program is the one whose traced backward starts from those outputs
  (a child's unused outputs, such as the last layer of a tower whose second-to-last layer is read,
  get no gradient); the spine's own autograd nodes on those paths get a pre- and post-hook that
  measure their backward ops when the backward runs, added to the meter then.

The measured values enter a :class:`~fxflops.program.Program` whose columns are one symbol per
(module, phase, kind, causal) of measured work (:class:`MeasuredColumns`), so meters, conventions,
breakdowns and distributed sums treat them as any other program; ``program.measured`` says which
modules were measured and why (the refusal, with its line). A call is added only whole: if any part
fails the call is not counted (``uncounted``, warned), never counted in part.
"""

from __future__ import annotations

import threading
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils.hooks import RemovableHandle

from fxflops.analysis import Analysis
from fxflops.analysis.masks import CAUSAL_ARGUMENTS
from fxflops.analysis.paths import ancestors
from fxflops.analysis.terms import Term, Unsupported
from fxflops.backward import GRAPH_RECORDED, BackwardBill, bill_backward, output_nodes
from fxflops.binder import Binder
from fxflops.capture.outputs import backward_roots, output_tensors
from fxflops.capture.isolation import isolated_call
from fxflops.errors import CaptureError, FxFlopsError
from fxflops.program import Program
from fxflops.routing import dispatched_flops
from fxflops.rules import entry_for, overlaid, registry_version
from fxflops.rules.not_counted import touches_floats
from fxflops.rules.registry import shape_of
from fxflops.rules.work import work_without_rule
from fxflops.situation import STRUCTURE

if TYPE_CHECKING:
    from fxflops.instrument import Instrumented

_sequence_nr = torch._C._autograd._get_sequence_nr  # the autograd node counter of this thread

Key = tuple[str, str, str, bool]  # (module, phase, kind, causal): one measured column (two when causal)


def op_work(func: Any, args: tuple, kwargs: dict, out: Any, entry: Any = False) -> tuple[str, Any, Any, Any] | None:
    """(kind, dense FLOPs, exact causal FLOPs or None, recomputed share or None) of one executed op,
    from fxflops' rules on its concrete shapes, as the analysis counts a traced node
    (``analysis/nodes.py``); ``("unsupported", 0, None, None)`` for a floating op without a rule;
    None for an op that does no floating-point work. ``entry``: the op's rule entry when the caller
    looked it up already (None: it has none)."""
    entry = entry_for(func) if entry is False else entry
    if entry is None:
        return unruled_work(work_without_rule(func), args, kwargs, out)
    if entry.segments:  # a varlen op's offsets are data: the binder's device sums, not measured here
        raise CaptureError(f"{func} (varlen attention) in measured code is not counted")
    if getattr(func, "overloadpacket", None) is torch.ops.aten._grouped_mm:
        return entry.kind, dispatched_flops(func, args, kwargs, out), None, None
    shapes, named, out_shape = shape_of(args), {k: shape_of(v) for k, v in kwargs.items()}, shape_of(out)
    dense = entry.rule(*shapes, out_shape=out_shape, **named)
    exact = entry.causal(*shapes, out_shape=out_shape, **named) if entry.causal is not None and _says_causal(func, args, kwargs) else None
    share = entry.recomputed(*shapes, out_shape=out_shape, **named) if entry.recomputed is not None else None
    return entry.kind, dense, exact, share


def unruled_work(kind: str, args: tuple, kwargs: dict, out: Any) -> tuple[str, Any, Any, Any] | None:
    """:func:`op_work` of an op without a rule, of ``kind`` (``work_without_rule``): elementwise_cost
    on concrete tensors, 1 per output element (pointwise) or per input element (reduction)."""
    if kind == "none" or not touches_floats([*args, *kwargs.values()], out):
        return None
    if kind == "unsupported":
        return "unsupported", 0, None, None
    counted = out if kind == "pointwise" else args[0] if args else None
    cost = counted.numel() if isinstance(counted, torch.Tensor) else 0
    return ("elementwise", cost, None, None) if cost else None


def _says_causal(func: Any, args: tuple, kwargs: dict) -> bool:
    schema = getattr(func, "_schema", None)
    given = dict(zip((a.name for a in schema.arguments), args)) if schema is not None else {}
    given |= kwargs
    return any(given.get(name) is True for name in CAUSAL_ARGUMENTS)


_PRICED_BY_VALUES = frozenset({torch.ops.aten._grouped_mm})  # FLOPs read from offsets in the data


def _signature(value: Any) -> Any:
    """What an op's price depends on in ``value``: each tensor's shape and dtype (the rules read
    shapes, :func:`touches_floats` dtypes), every other value as it is (``causal=True``)."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype
    if isinstance(value, (list, tuple)):  # tensors inline: an op's arguments are mostly tensors
        return tuple([(v.shape, v.dtype) if isinstance(v, torch.Tensor) else _signature(v) for v in value])
    if isinstance(value, dict):
        return tuple([(k, _signature(v)) for k, v in value.items()])
    return value


_UNPRICED = object()


class Prices:
    """:func:`op_work` of each op by its :func:`_signature`, kept across a spine's calls: the rules
    are pure functions of the shapes, so an op run again on the same shapes (every call of a
    situation, an image loop) is priced by one dict lookup. An op without a rule (a view, a copy, a
    pointwise op) is priced from its kind, kept per op, and its tensors' element counts, with no
    signature. Not kept: ops priced by their data (``_grouped_mm``), signatures that cannot be
    hashed, ops whose pricing raised. :meth:`current` empties it when the rule registry changed
    (``register``/``unregister``); the per-use ``rules`` are the owner's, fixed for its spines."""

    LIMIT = 4096  # distinct signatures kept (a model varying shapes without end starts over)

    def __init__(self) -> None:
        self.known: dict[tuple, Any] = {}
        self.entries: dict[Any, Any] = {}  # op -> its rule entry, or the kind of an op without one
        self.version = registry_version()

    def current(self) -> Prices:
        if self.version != registry_version() or len(self.known) > self.LIMIT:
            self.known, self.entries, self.version = {}, {}, registry_version()
        return self

    def of(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: Any) -> tuple[str, Any, Any, Any] | None:
        try:
            entry = self.entries[func]
        except KeyError:
            with overlaid(rules):
                found = entry_for(func)
            entry = self.entries[func] = found if found is not None else work_without_rule(func)
        except TypeError:  # an op that cannot be hashed
            entry = False
        if isinstance(entry, str):
            return unruled_work(entry, args, kwargs, out)
        key = (func, _signature(args), _signature(kwargs) if kwargs else None, _signature(out))
        try:
            priced = self.known.get(key, _UNPRICED)
        except TypeError:  # an argument that cannot be hashed
            key, priced = None, _UNPRICED
        if priced is not _UNPRICED:
            return priced
        with overlaid(rules):
            priced = op_work(func, args, kwargs, out, entry)
        if key is not None and getattr(func, "overloadpacket", None) not in _PRICED_BY_VALUES:
            self.known[key] = priced
        return priced


class Work:
    """Measured work by :data:`Key`: ``dense`` and ``exact`` (causal) sums, and the unsupported ops."""

    def __init__(self) -> None:
        self.dense: dict[Key, Any] = defaultdict(int)
        self.exact: dict[Key, Any] = defaultdict(int)
        self.unsupported: set[tuple[str, str]] = set()

    def add(self, module: str, phase: str, func: Any, work: tuple[str, Any, Any, Any]) -> None:
        """Book one op's :func:`op_work` under ``module`` and ``phase``."""
        kind, dense, exact, share = work
        if kind == "unsupported":
            self.unsupported.add((str(func), module))
            return
        if share is not None and phase == "bwd":  # a fused backward's recomputation of forward work
            share = sympy.Rational(share)
            again = (dense * share, None if exact is None else exact * share)
            parts = [("bwd", dense - again[0], None if exact is None else exact - again[1]), ("recompute", *again)]
        else:
            parts = [(phase, dense, exact)]
        for ph, flops, causal in parts:
            key = (module, ph, kind, causal is not None)
            self.dense[key] += flops
            if causal is not None:
                self.exact[key] += causal

    def __bool__(self) -> bool:
        return bool(self.dense or self.unsupported)

    def clear(self) -> None:
        self.dense.clear()
        self.exact.clear()
        self.unsupported.clear()


def _untraced(code: types.CodeType) -> bool:
    """Mark ``code`` for Dynamo to skip, with every frame it calls (what ``torch._disable_dynamo``
    does per call, set once); False where this torch has no such switch."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return False
    return True


class OwnOps(TorchDispatchMode):
    """Adds every op run while active to ``work`` under ``module()`` and ``phase``, priced by
    ``prices`` (a :class:`Prices`) with the per-use ``rules``. The model's ops run and raise as they
    would; a failure of the accounting is kept in ``error`` (the call is then not counted), never
    raised into the model.

    torch wraps a mode's ``__torch_dispatch__`` in ``torch._disable_dynamo`` (Dynamo must not trace
    the mode's own frames when a compiled region runs under it), about 1.3 µs per op. This mode's
    code is marked for Dynamo to skip instead, with the frames it calls (:func:`_untraced`): nothing
    per op. Where that cannot be marked, torch's wrapper stays."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # asked once, as the class is made
        raw = cls.__dict__.get("__torch_dispatch__")
        return not (isinstance(raw, types.FunctionType) and _untraced(raw.__code__))

    def __init__(self, work: Work, module: Callable[[], str], phase: str, rules: Any, prices: Prices, seen: dict[int, str] | None = None) -> None:
        super().__init__()
        self.work, self.module, self.phase, self.rules = work, module, phase, rules
        self.prices = prices.current()
        self.seen = seen  # autograd sequence number -> the module whose op made that node (forward)
        self.error: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.error is None:
            try:
                module = self.module()
                if self.seen is not None:  # the node this op made, if it made one (its number is taken first)
                    self.seen.setdefault(_sequence_nr() - 1, module)
                work = self.prices.of(func, args, kwargs, out, self.rules)
                if work is not None:
                    self.work.add(module, self.phase, func, work)
            except Exception as exc:  # noqa: BLE001 - telemetry never breaks the model
                self.error = f"{func}: {type(exc).__name__}: {exc}"
        return out


class Spine:
    """Where a situation's calls are measured: ``paths``, the modules whose own code is measured
    (each failing module and its ancestors), and ``reasons``, the refusal of each failing module's
    capture (its line). Extended when a child's capture fails inside it."""

    def __init__(self, failing: str, reason: str) -> None:
        self.paths: set[str] = set()
        self.reasons: dict[str, str] = {}
        self.columns = MeasuredColumns()
        self.prices = Prices()
        self.add(failing, reason)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("prices")  # a cache (ops as keys): rebuilt on load
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.prices = Prices()

    @classmethod
    def whole(cls, model: torch.nn.Module, reason: str) -> Spine:
        """A spine measuring every module's own code (no child is captured): for a situation that gets
        no program of its own (the wrapper has captured ``max_programs``)."""
        spine = cls("", reason)
        spine.paths.update(path for path, _ in model.named_modules())
        return spine

    def add(self, failing: str, reason: str) -> None:
        self.paths.update(ancestors(failing))
        self.reasons[failing] = reason


class MeasuredColumns:
    """The measured :class:`Program` of a spine: a symbol per :data:`Key` measured so far (and one
    for the exact count of causal keys). A call that measures a new key makes a new version (the
    Meter keeps each version's sums: breakdowns add them up)."""

    def __init__(self) -> None:
        self.symbols: dict[Key, tuple[sympy.Symbol, sympy.Symbol | None]] = {}
        self.unsupported: set[tuple[str, str]] = set()
        self.program: Program | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def monomials(self, work: Work, model: torch.nn.Module, spine: Spine, backward: str) -> tuple[Program, tuple]:
        """The program holding every key of ``work`` and ``work``'s monomial vector for it."""
        with self._lock:
            if self.program is None or any(k not in self.symbols for k in work.dense) or work.unsupported - self.unsupported:
                for key in work.dense:
                    if key not in self.symbols:
                        i = len(self.symbols)
                        exact = sympy.Symbol(f"measured_{i}_exact", integer=True, nonnegative=True) if key[3] else None
                        self.symbols[key] = (sympy.Symbol(f"measured_{i}", integer=True, nonnegative=True), exact)
                self.unsupported |= work.unsupported
                self.program = self._program(model, spine, backward)
            program = self.program
        values = {}
        for key, (dense, exact) in self.symbols.items():
            values[dense] = work.dense.get(key, 0)
            if exact is not None:
                values[exact] = work.exact.get(key, 0)
        return program, program.monomials(*(_whole(values[s]) for s in program.all_symbols))

    def _program(self, model: torch.nn.Module, spine: Spine, backward: str) -> Program:
        terms = [
            Term(f"measured_{i}", "measured", module, phase, dense, kind, exact)
            for i, ((module, phase, kind, _), (dense, exact)) in enumerate(self.symbols.items())
        ]
        symbols = tuple(sorted((s for pair in self.symbols.values() for s in pair if s is not None), key=str))
        unsupported = [Unsupported("measured", op, module) for op, module in sorted(self.unsupported)]
        notes = [f"{path or '<root>'}: measured per call ({reason})" for path, reason in spine.reasons.items()]
        analysis = Analysis(terms, unsupported, notes, [], {}, {}, (), {}, {})
        program = Program(analysis, Binder(model.forward, {}, symbols), symbols, [], spine.paths, backward=backward)
        program.measured = spine.reasons  # the spine's own: a module joining it later is named too
        return program


def _whole(value: Any) -> Any:
    """A measured sum as the Meter accumulates it: an int (rational shares of a fused backward are
    whole numbers summed), or a 0-d tensor from device offsets."""
    return int(value) if isinstance(value, (int, sympy.Basic)) else value


@dataclass
class _ChildCall:
    """One call of a child counted by its own program: the call, its output leaves and inputs, and the
    autograd sequence numbers its nodes got."""

    path: str
    counter: Instrumented
    found: tuple  # (program, symbol values) of the call as the child got it (before it could change its arguments)
    snapshot: tuple | None  # (args, kwargs) copied before the call (opaque objects: a cache it fills), for training
    outputs: list[torch.Tensor]
    inputs: list[torch.Tensor]
    first: int
    end: int
    defaults: set[int]  # the outputs a capture differentiates by default (that require grad)


@dataclass
class _Routed:
    """The instance-level ``_call_impl`` route installed on one module while measured calls run."""

    method: Callable[..., Any]  # _call_impl bound to the module
    module: torch.nn.Module
    original: Callable[..., Any]  # what the module's calls ran before
    users: int = 0


_ROUTES: dict[int, _Routed] = {}  # id(module) -> its route
_ROUTES_LOCK = threading.Lock()
_CALLS: dict[int, MeasuredCall] = {}  # thread -> the measured call it runs


def _call_impl(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The route a measured call installs on a module (bound to it as its instance ``_call_impl``):
    in the thread of a measured call, the call enters it; anywhere else, and on any other module,
    the module runs as always. Bound to the module, it follows a copy of it: ``copy.deepcopy`` of a
    routed module (a teacher copied from the student inside a measured forward) binds it to the copy,
    which is not routed and runs its own code; pickling it (``torch.save`` from another thread) saves
    the name ``_call_impl``, which a loaded module resolves to its class's own."""
    routed = _ROUTES.get(id(self))
    if routed is None or routed.module is not self:
        return type(self)._call_impl(self, *args, **kwargs)
    run = _CALLS.get(threading.get_ident())
    if run is None or run.closed:
        return routed.original(*args, **kwargs)
    return run.enter(self, routed.original, args, kwargs)


_call_impl.fxflops_own = True  # not the model's (call situations, capture twins)


def _install(module: torch.nn.Module) -> None:
    with _ROUTES_LOCK:
        routed = _ROUTES.get(id(module))
        if routed is None:
            original = vars(module).get("_call_impl") or type(module)._call_impl.__get__(module)
            routed = _ROUTES[id(module)] = _Routed(types.MethodType(_call_impl, module), module, original)
            vars(module)["_call_impl"] = routed.method
        routed.users += 1


def _uninstall(module: torch.nn.Module) -> None:
    with _ROUTES_LOCK:
        routed = _ROUTES[id(module)]
        routed.users -= 1
        if not routed.users:
            del _ROUTES[id(module)]
            if vars(module).get("_call_impl") is routed.method:
                del vars(module)["_call_impl"]


class MeasuredCall:
    """One call of a :class:`Spine` situation of ``owner`` (see the module docstring): ``run``
    runs it, then ``counted`` adds it to the meter whole, or raises when a part could not be counted."""

    def __init__(self, owner: Instrumented, spine: Spine, training: bool) -> None:
        self.owner, self.spine, self.training = owner, spine, training
        self.model = owner._traced
        self.paths: dict[int, str] = {}  # routed modules -> their paths (the spine modules and their children)
        self.stack = [""]  # spine modules whose own code runs, innermost last
        self.work = Work()
        self.seen: dict[int, str] = {}  # sequence number -> own module (for the backward's attribution)
        self.mode = OwnOps(self.work, lambda: self.stack[-1], "fwd", owner._rules, spine.prices, self.seen if training else None)
        self.children: list[_ChildCall] = []
        self.routed: list[torch.nn.Module] = []
        self.child_running = False
        self.closed = False
        self.error: str | None = None

    # ---- running -------------------------------------------------------------------------
    def run(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``forward(*args, **kwargs)`` (the model's call), measured; the model's own exceptions
        propagate, fxflops' are kept for :meth:`counted`."""
        me = threading.get_ident()
        outer = _CALLS.get(me)
        self.first = _sequence_nr()
        try:
            try:
                self._route(self.spine.paths)
            except Exception as exc:  # noqa: BLE001 - telemetry never breaks the model: this call is not counted
                self.error = f"routing the measured modules: {type(exc).__name__}: {exc}"
                return forward(*args, **kwargs)
            _CALLS[me] = self
            _push_mode(self.mode)
            return forward(*args, **kwargs)
        finally:
            self.end = _sequence_nr()
            self.closed = True
            self._remove_mode()
            if outer is None:
                _CALLS.pop(me, None)
            else:
                _CALLS[me] = outer
            for module in self.routed:
                _uninstall(module)

    def _route(self, spine_paths: set[str] | list[str]) -> None:
        """Route the spine modules among ``spine_paths`` (but the root) and their children. A
        TorchScript model calls its submodules inside TorchScript: none is routed, all its ops are
        measured as the root's."""
        if isinstance(self.model, torch.jit.ScriptModule):
            return
        for path in sorted(spine_paths):
            try:
                module = self.model.get_submodule(path)
            except AttributeError:
                continue
            targets = [(path, module)] if path else []
            targets += _called_children(module, path)
            for target_path, target in targets:
                self.paths.setdefault(id(target), target_path)
                if all(target is not routed for routed in self.routed):
                    _install(target)
                    self.routed.append(target)

    def _remove_mode(self) -> None:
        _remove_modes(lambda mode: mode is self.mode)

    def enter(self, module: torch.nn.Module, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A routed module called in this thread during the call."""
        path = self.paths.get(id(module))
        if self.child_running or path is None:  # a child calling a routed module: part of the child
            return original(*args, **kwargs)
        if path in self.spine.paths:
            self.stack.append(path)
            try:
                return original(*args, **kwargs)
            finally:
                self.stack.pop()
        return self._child(module, path, original, args, kwargs)

    def _child(self, module: torch.nn.Module, path: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A child of a spine module: looked up (or captured) with the mode popped, then run unmeasured."""
        suspended = self._suspend()
        counter = found = snapshot = None
        try:
            counter = self.owner.child_counter(path, module)
            args, kwargs = counter._prepare(args, kwargs)
            # before the child runs: it may fill an argument object (a key-value cache); a capture
            # that fails inside the child makes it a spine module
            found = counter._program_for(args, kwargs)
            snapshot = isolated_call(args, kwargs)[:2] if self.training else None
        except CaptureError as exc:
            if exc.module is not None and self.owner._measure:
                self.spine.add(_joined(path, exc.module), f"{path}: {exc}")
                self._route([p for p in self.spine.paths if p.startswith(path)])
                self._resume(suspended)
                return self.enter(module, original, args, kwargs)
            self.error = self.error or f"{path}: {exc}"
        except Exception as exc:  # noqa: BLE001 - counted as not counted, the model runs
            self.error = self.error or f"{path}: {type(exc).__name__}: {exc}"
        first = _sequence_nr()
        self.child_running = True
        try:
            out = original(*args, **kwargs)
        finally:
            self.child_running = False
            self._resume(suspended)
        if found is not None and not self.training:
            self.children.append(_ChildCall(path, counter, found, None, [], [], first, _sequence_nr(), set()))
        elif found is not None:  # what the walk of the autograd graph needs (``_reached``)
            outputs = output_tensors(out)
            inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            roots = {id(t) for t in backward_roots(out, outputs)}
            defaults = {i for i, t in enumerate(outputs) if id(t) in roots and t.requires_grad}
            self.children.append(_ChildCall(path, counter, found, snapshot, outputs, inputs, first, _sequence_nr(), defaults))
        return out

    def _suspend(self) -> bool:
        """Pop the mode if it is on top of the stack (True); a mode the model entered above it keeps it
        (the call cannot be measured: its children would run measured)."""
        stack = _get_current_dispatch_mode_stack()
        if stack and stack[-1] is self.mode:
            _pop_mode()
            return True
        self.error = self.error or "a dispatch mode the model entered is above the measuring one"
        return False

    def _resume(self, suspended: bool) -> None:
        if suspended:
            _push_mode(self.mode)

    # ---- counting ------------------------------------------------------------------------
    def counted(self, out: Any, training: bool, phase: str = "fwd", call: bool = True) -> None:
        """Add the call to the owner's meter (every part, or nothing: raises naming the failed part);
        ``training``: a backward follows (else the forward counts as ``phase``); ``call=False``: a
        part of a call (not counted as a call of its own)."""
        if self.error is None and self.mode.error is not None:
            self.error = self.mode.error
        if self.error is not None:
            raise FxFlopsError(f"{type(self.model).__name__}: measured call not counted: {self.error}")
        reached = self._reached(out) if training else {}
        parts = []
        for child in self.children:
            roots = _roots(child, reached.get(id(child), set())) if training else None
            program, values = child.found if roots is None else child.counter._program_for(*child.snapshot, roots)
            parts.append((program, child.counter._monomials(program, values), child, roots))
        columns = self.spine.columns
        program, monomials = columns.monomials(self.work, self.model, self.spine, self.owner._backward)
        meter = self.owner.flops
        meter.add(program, monomials, training, phase=phase, call=call)  # its own backward: measured as it runs (_measure_backward)
        for child_program, child_monomials, child, roots in parts:
            self._add_child(child_program, child_monomials, child, roots, training)
        if training and self.owner._backward == "traced":
            graphed = _GraphRecorded(self.owner)
            before = RemovableHandle.next_id
            for node in self.own_nodes:
                module = self.seen.get(node._sequence_nr(), max(self.spine.paths, key=len))
                _measure_backward(node, self.owner, self.spine, self.model, module, graphed)
            STRUCTURE.own_handles(before, 2 * len(self.own_nodes))  # a pre- and a post-hook each: fxflops' own
        self.children, self.own_nodes = [], []  # nothing of the call's autograd graph stays held

    def _add_child(self, program: Program, monomials: tuple, child: _ChildCall, roots: tuple[int, ...] | None, training: bool) -> None:
        """A symbolic child's count: its forward now, its backward (training) when a backward pass runs
        it (``fxflops/backward.py``: each pass, none for a pass through part of it, said), or with
        the forward where its outputs' nodes cannot be seen (a leaf returned as it is)."""
        meter = self.owner.flops
        reached = [child.outputs[i] for i in (sorted(child.defaults) if roots is None else roots)]
        nodes, root_nodes = output_nodes(child.outputs), output_nodes(reached)
        if not training or self.owner._backward != "traced" or not nodes or not root_nodes:
            meter.add(program, monomials, training, prefix=child.path, call=False)
            return
        meter.add(program, monomials, False, prefix=child.path, call=False)
        warn = self.owner._warn_once
        bill_backward(BackwardBill(meter, program, monomials, child.path, len(root_nodes), warn), nodes, root_nodes)

    def _reached(self, out: Any) -> dict[int, set[int]]:
        """Which output leaves of each child the backward from the loss (or every floating output)
        reaches: a walk of the autograd graph over this call's own nodes, jumping across each child
        from its outputs to its inputs. Also collects those own nodes (``own_nodes``)."""
        leaves = output_tensors(out)
        outputs_at: dict[tuple[Any, int], list[tuple[_ChildCall, int]]] = defaultdict(list)
        for child in self.children:
            for i, tensor in enumerate(child.outputs):
                if tensor.grad_fn is not None:
                    outputs_at[(tensor.grad_fn, tensor.output_nr)].append((child, i))
        reached: dict[int, set[int]] = defaultdict(set)
        crossed: set[int] = set()
        visited: set[Any] = set()
        self.own_nodes: list[Any] = []
        frontier = [(t.grad_fn, t.output_nr) for t in backward_roots(out, leaves) if t.grad_fn is not None]
        while frontier:
            node, output = frontier.pop()
            hits = outputs_at.get((node, output), ())
            for child, i in hits:
                reached[id(child)].add(i)
                if id(child) not in crossed:
                    crossed.add(id(child))
                    frontier += [(t.grad_fn, t.output_nr) for t in child.inputs if t.grad_fn is not None]
            if node in visited or not self._own(node):
                continue
            visited.add(node)
            self.own_nodes.append(node)
            frontier += [(n, i) for n, i in node.next_functions if n is not None]
        return reached

    def _own(self, node: Any) -> bool:
        """A node this call's own code made: its sequence number is the call's, and no child's."""
        number = node._sequence_nr()
        if not self.first <= number < self.end:
            return False
        return not any(child.first <= number < child.end for child in self.children)


def _roots(child: _ChildCall, reached: set[int]) -> tuple[int, ...] | None:
    """The output leaves a child's traced backward starts from: None (the capture's default, the
    loss or every floating output) when those are the ones the call's backward reaches."""
    return None if reached == child.defaults else tuple(sorted(reached))


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)  # never called: their code calls what they hold


def _called_children(module: torch.nn.Module, path: str) -> list[tuple[str, torch.nn.Module]]:
    """The modules ``module``'s own code can call as its children: its children, and the modules held
    by a child ``ModuleList`` / ``ModuleDict`` (``for layer in self.layers``), with their paths."""
    found = []
    for name, child in module.named_children():
        if child is None:
            continue
        child_path = _joined(path, name)
        found += _called_children(child, child_path) if isinstance(child, _CONTAINERS) else [(child_path, child)]
    return found


def _remove_modes(which: Callable[[Any], bool]) -> None:
    """Take the modes ``which`` selects off this thread's dispatch mode stack, wherever they are (the
    others, a model's own modes included, stay in their order)."""
    stack = _get_current_dispatch_mode_stack()
    if not any(which(mode) for mode in stack):
        return
    popped = [_pop_mode() for _ in stack]  # top first
    for mode in reversed(popped):
        if not which(mode):
            _push_mode(mode)


def _joined(prefix: str, path: str) -> str:
    return ".".join(p for p in (prefix, path) if p)


class _GraphRecorded:
    """Whether a backward with ``create_graph=True`` ran a measured call's own nodes: it records the
    gradients' own graph, which a later pass may differentiate (a gradient penalty) with work no
    hook sees; that pass and every later one are not counted (said once per pass)."""

    def __init__(self, owner: Instrumented) -> None:
        self.owner, self.seen, self.refused = owner, False, set()

    def refuses(self) -> bool:
        self.seen = self.seen or torch.is_grad_enabled()
        task = torch._C._current_graph_task_id()
        if self.seen and task not in self.refused:
            self.refused.add(task)
            self.owner.flops.not_counted()
            self.owner._warn_once(GRAPH_RECORDED)
        return self.seen


def _measure_backward(node: Any, owner: Instrumented, spine: Spine, model: torch.nn.Module, module: str, graphed: _GraphRecorded) -> None:
    """Measure ``node``'s backward ops each time a backward runs it (pushed in its pre-hook, popped in
    its post-hook, in the thread that runs it), and add them to the meter as the call's backward
    (unless ``graphed`` refuses the pass). The hooks hold no autograd node (``fxflops/backward.py``:
    a cycle through autograd's edges)."""
    work = Work()
    mode = OwnOps(work, lambda: module, "bwd", owner._rules, spine.prices)

    def before(grad_outputs: Any) -> None:
        _push_mode(mode)  # the engine restores the thread's modes after each node, also when it raises

    def after(grad_inputs: Any, grad_outputs: Any) -> None:
        _remove_modes(lambda m: m is mode)
        if not work:
            return
        try:
            if graphed.refuses():
                return
            if mode.error is not None:
                raise FxFlopsError(mode.error)
            program, monomials = spine.columns.monomials(work, model, spine, owner._backward)
            owner.flops.add(program, monomials, True, call=False)
        except Exception as exc:  # noqa: BLE001 - a backward is never broken by telemetry
            owner._warn_once(f"the measured backward of {module or '<root>'} is not counted: {exc}")
        finally:
            work.clear()  # each run of the node is measured on its own (a retained graph's next pass)

    node.register_prehook(before)
    node.register_hook(after)


def measured_paths(spines: Iterator[Spine]) -> dict[str, str]:
    """Failing module -> why it is measured, over ``spines``."""
    found: dict[str, str] = {}
    for spine in spines:
        found.update(spine.reasons)
    return found


__all__ = ["MeasuredCall", "MeasuredColumns", "OwnOps", "Prices", "Spine", "Work", "measured_paths", "op_work"]
