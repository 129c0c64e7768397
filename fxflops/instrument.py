"""``instrument(model)``: a wrapper that counts every call's FLOPs from its shapes.

The wrapper's forward runs the model unchanged and returns its output. The first call is the example:
the model is captured symbolically (fake tensors, no real compute) into a :class:`Program`. Nothing is
attached to the model: no hooks, no modes; the wrapper shares the model's parameter, buffer and
submodule dicts, so ``state_dict()`` keys, ``parameters()`` and ``.to()`` are the model's own.

A count belongs to the call that ran. Every call is matched to a program by its *situation*
(``fxflops/situation.py``): the call (inputs present or ``None``, dtypes, devices, ``requires_grad``,
Python arguments), the grad/autocast/attention-backend modes, and the model state the trace read
(``training`` flags, flags and settings of modules and configs, which parameters require grad, the
modules themselves). Within a situation, the program's guards on the sizes must hold. A call that no
program describes is captured as a new program (``on_miss="recapture"``, the default) or refused
with :class:`GuardError` (``on_miss="raise"``).

Telemetry never stops training: unless ``strict=True``, no exception raised by fxflops while
preparing, matching, capturing or counting a call reaches the caller — the call is counted in
``wrapper.flops.uncounted`` and the cause is warned about once. A call layout whose capture failed is
not traced again on every call: the refusal is kept for its situation and size class (sizes 0, 1 or
more per dim), and a situation is tried at most :data:`MAX_ATTEMPTS` times.

With ``torch.compile``, either order works. ``instrument(torch.compile(model))`` runs the compiled
module and captures its original one (``capture/engines.py``: :func:`traced_module`).
``torch.compile(instrument(model))`` compiles the model's call and keeps the counting eager: under
Dynamo the wrapper's forward looks the program up and adds the count in functions Dynamo does not
trace (``torch.compiler.disable``: a graph break on each side of the model's call; with
``fullgraph=True`` compile the model and instrument the compiled module instead).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import inspect
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.utils.parametrize as parametrize
import torch.utils._pytree as pytree
import torch.utils.checkpoint as checkpoint_module

from fxflops.call_keys import CallKeys
from fxflops.capture.engines import not_a_microbatch, traced_module, transform_around
from fxflops.capture.inputs import signature_of
from fxflops.capture.outputs import backward_roots, output_tensors
from fxflops.capture.scope import capturing
from fxflops.errors import CaptureError, FxFlopsError, GuardError, InputError, MetadataError, warn
from fxflops.adapters import adapter_for
from fxflops.backward import BackwardBill, bill_backward, output_nodes
from fxflops.generation import ENCODE, counting_own_calls, generated_tokens
from fxflops.islands import MeasuredCall, Spine
from fxflops.meter import RECOMPUTED, Meter
from fxflops.build import build_program
from fxflops.program import Program, backward_rule
from fxflops.routing import RoutingProbes
from fxflops.rules import per_use_entries
from fxflops.situation import ModelState, describe_difference, mode_key, note_reparametrization

ON_MISS = ("recapture", "raise")
MAX_ATTEMPTS = 3  # captures tried per situation before its calls are refused outright
_STOPPED_RECOMPUTATION = getattr(checkpoint_module, "_StopRecomputationError", ())  # a non-reentrant checkpoint's early stop
RECENT = 4  # programs per call layout whose situations are recognised by generated tests (CallKeys.check)


@dataclass
class _Refusal:
    """A capture that failed: for calls of this size class with the model in this state."""

    sizes: tuple
    state: ModelState | None
    reason: str
    module: str | None = None  # where the capture failed (CaptureError.module)
    spine: Spine | None = None  # its calls are measured there instead (fxflops/islands.py)


@dataclass
class _Branch:
    """The programs of one situation (call key + modes), and the captures that failed in it."""

    programs: list[Program] = field(default_factory=list)
    refusals: list[_Refusal] = field(default_factory=list)
    attempts: int = 0

    def find(self, args: tuple, kwargs: dict) -> tuple[Program | None, tuple | str]:
        """(program, symbol values) of the first program whose model state and guards this call meets,
        else (None, why not). Malformed metadata raises :class:`MetadataError` (no re-capture)."""
        miss: Callable[[], str] = lambda: "no program captured yet for this situation"
        for program in self.programs:  # why the last one does not apply is put in words only when none does
            if program.state is not None and not program.state.matches():
                miss = functools.partial(_state_mismatch, program.state)
                continue
            try:
                values = program.binder.values(args, kwargs)
            except MetadataError:
                raise
            except InputError as exc:
                miss = functools.partial(str, exc)
                continue
            if program.within_guards(*values):
                return program, values
            miss = functools.partial(program.explain_guard_failure, values)
        return None, miss()

    def refusal(self, sizes: tuple) -> _Refusal | None:
        """The failed capture a call of this size class meets without another capture, or None: one
        measured instead (``spine``: measuring is exact at any size, so one that failed in a module
        serves every size class of the situation; one no module is named for, its own), else the
        last refusal once :data:`MAX_ATTEMPTS` failed."""
        held = [r for r in self.refusals if r.state is None or r.state.matches()]
        measured = next((r for r in held if r.spine is not None and (r.module is not None or r.sizes == sizes)), None)
        if measured is not None:
            return measured
        found = [r for r in held if r.sizes == sizes]
        if self.attempts >= MAX_ATTEMPTS:
            last = self.refusals[-1]
            reason = f"{last.reason} (after {self.attempts} failed captures of this call layout, not trying again)"
            return _Refusal(last.sizes, last.state, reason, last.module)
        return found[0] if found else None


def _lazy(model: torch.nn.Module) -> bool:
    """Whether a parameter or buffer of ``model`` is not made yet (``nn.LazyLinear`` before its first call)."""
    return any(map(torch.nn.parameter.is_lazy, itertools.chain(model.parameters(), model.buffers())))


def _cached_parametrizations(model: torch.nn.Module) -> bool:
    """Whether ``model`` has parametrized tensors and runs inside ``parametrize.cached()`` (the
    first read of each in the context computes it, the later ones find it: work a program cannot hold)."""
    return parametrize._cache_enabled > 0 and any(map(parametrize.is_parametrized, model.modules()))


def _state_mismatch(state: ModelState) -> str:
    return f"the model is not in the state the program was traced in: {state.mismatch()}"


def _size_class(args: tuple, kwargs: dict) -> tuple:
    """Every tensor dim as 0, 1 or 2 (= more): sizes that can make a trace take another path (a
    nested tensor, which has no plain sizes: its rank)."""
    return tuple(
        ("nested", leaf.dim()) if leaf.is_nested else tuple(min(int(d), 2) for d in leaf.shape)
        for leaf in pytree.tree_leaves((args, kwargs))
        if isinstance(leaf, torch.Tensor)
    )


_PRIVATE = {  # the wrapper's own settings, private: a model's child or attribute of the same name (an
    # ``adapter``, a ``prefix`` encoder, Hugging Face's ``model``) is the model's, as through the model
    name: "_" + name for name in (
        "model", "traced", "adapter", "dims", "segments", "per_segment", "backward", "strict_metadata", "on_miss",
        "strict", "max_programs", "measure", "prefix", "rules", "routing",
    )
}


_MEASURED_ADVICE = "such calls are measured op by op (exact, slower)"
_MAX_PROGRAMS_ADVICE = (
    "calls of this situation and later new ones are measured op by op (exact, slower); a Python argument that changes "
    "every call (a length, a count) makes a new situation each time: pass it as a tensor, or raise max_programs"
)


class Instrumented(torch.nn.Module):
    """The model behind ``fxflops.instrument``; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        dims: dict[str, dict[int, str]] | None,
        segments: dict[str, str] | None,
        per_segment: dict[str, str] | None,
        strict_metadata: bool,
        backward: bool | str,
        on_miss: str,
        strict: bool,
        max_programs: int,
        meter: Meter | None,
        measure_routing: bool = False,
        rules: Mapping[Any, Any] | None = None,
        measure: bool = True,
        prefix: str = "",
    ) -> None:
        if on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {ON_MISS}, not {on_miss!r}")
        super().__init__()
        # Share the model's registries (not a child module): state_dict keys stay the model's.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self._modules = model._modules
        for hooks in _STATE_DICT_HOOKS:  # the root's state_dict and load hooks are the model's
            setattr(self, hooks, getattr(model, hooks))
        object.__setattr__(self, "_model", model)  # what a call runs
        object.__setattr__(self, "_traced", traced_module(model))  # whose code a capture traces
        self._dims = dims
        self._segments = segments
        self._per_segment = per_segment
        self._backward = backward_rule(backward)
        self._strict_metadata = strict_metadata
        self._on_miss = on_miss
        self._strict = strict
        self._max_programs = max_programs
        self._measure = measure  # calls whose capture fails in a module are measured there (fxflops/islands.py)
        self._prefix = prefix  # the module path this wrapper counts at (a measured call's child)
        self._children: dict[str, Instrumented] = {}  # a measured call's children, each counted by its own programs
        self._adapter = adapter_for(self._traced)
        # Python int arguments traced as symbols: the adapter's, and those dims names with a string
        symbolic = self._adapter.symbolic_arguments | {name for name, spec in (dims or {}).items() if isinstance(spec, str)}
        self._call_keys = CallKeys(self._traced.forward, frozenset(symbolic))
        self._rules = per_use_entries(rules) if rules else None  # per-use FLOPs rules (rules.overlaid): checked now
        self._routing = RoutingProbes(self._traced, self._rules) if measure_routing else None
        self.programs: list[Program] = []
        self.flops = meter if meter is not None else Meter()
        self.captures = 0
        self._branches: dict[tuple, _Branch] = {}
        self._warned: set[str] = set()
        not_a_microbatch()  # marks pipeline stages' shape inference when pipelining is loaded
        self._init_runtime()

    def _init_runtime(self) -> None:
        """What a copy or a load rebuilds: the forward with the model's signature, the capture lock."""
        # forward keeps the model's signature: frameworks read it (the HF Trainer keeps only the
        # dataset columns that are forward parameters, and finds label names there)
        self.forward = types.MethodType(_with_signature(type(self).forward, _signature_source(self._traced)), self)
        self._lock = threading.Lock()
        self._lock_owner: int | None = None  # the thread holding it
        self._attempt = threading.local()  # .failed: (branch, refusal) of a capture that failed on this thread's call
        self._recent: dict[tuple, tuple] = {}  # call layout -> (check, modes, program) of recent situations
        self._built = True  # from now on, a name the wrapper does not have is set on the model (__setattr__)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for runtime in ("forward", "_lock", "_lock_owner", "_attempt", "_recent", "_built"):
            state.pop(runtime, None)
        return state

    def __setstate__(self, state: dict) -> None:
        state = {_PRIVATE.get(name, name): value for name, value in state.items()}  # saved before they were private
        state = {"_measure": True, "_prefix": "", "_children": {}, **state}  # saved before measured islands
        self.__dict__.update(state)
        self._init_runtime()

    @property
    def wrapped_model(self) -> torch.nn.Module:
        """The model this wrapper runs and counts (its attributes and children are also the
        wrapper's: ``wrapper.model`` is a Hugging Face model's inner ``model``, as on the model)."""
        return self._model

    @property
    def program(self) -> Program | None:
        """The first captured program (``None`` before the first call)."""
        return self.programs[0] if self.programs else None

    @property
    def training(self) -> bool:
        """The model's own flag: ``model.train()``/``model.eval()`` called on the model, not on this
        wrapper, shows here too (a framework reading ``wrapper.training`` sees the model's mode)."""
        model = self.__dict__.get("_model")
        return True if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:  # nn.Module.__init__ sets it before the model is held
        model = self.__dict__.get("_model")
        if model is not None:
            model.training = mode

    def train(self, mode: bool = True) -> Instrumented:
        self._model.train(mode)
        return self

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # the root's own entries as the model saves them (its get_extra_state, an override)
        self._model._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # as the model loads them (its set_extra_state, an override renaming old keys)
        self._model._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_model"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A name the wrapper does not hold itself (its settings, meter and programs, ``nn.Module``'s
        own state, its class's attributes) is set on the model, as it is read from the model:
        ``wrapper.gradient_checkpointing = True`` reaches the model whose code reads it (as set on
        ``torch.compile``'s wrapper); children, parameters and buffers are the model's either way."""
        if self._owns(name):
            super().__setattr__(name, value)
        else:
            setattr(self._model, name, value)

    def __delattr__(self, name: str) -> None:
        if self._owns(name):
            super().__delattr__(name)
        else:
            delattr(self._model, name)

    def _owns(self, name: str) -> bool:
        own = self.__dict__
        return "_built" not in own or name in own or hasattr(type(self), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # torch.compile(instrument(model)): see the module docstring
            return self._compiled_forward(args, kwargs)
        if capturing() or id(self.flops) in _RUNNING.meters:
            # inside a capture (an instrumented submodule is traced as the model's code), or inside a
            # call this meter counts (a model calling its own wrapper): that call's count has this work
            return self._model(*args, **kwargs)
        self._attempt.failed = None
        args, kwargs, found, deferred = self._look_up(args, kwargs, defer=True)
        measured = found is not None and isinstance(found[0], Spine)
        recompute = torch._C._current_graph_task_id() != -1  # run by a backward: checkpoint() around this wrapper
        if recompute and measured:
            self._not_counted(CaptureError(f"{type(self._traced).__name__}: a measured call recomputed by checkpoint() is not counted"))
            found, measured = None, False
        try:
            with _running(self.flops):
                out = self._measured(found[0], self._model, args, kwargs) if measured else self._model(*args, **kwargs)
        except BaseException as exc:
            self._forget_failed_capture()
            if recompute and found is not None and isinstance(exc, _STOPPED_RECOMPUTATION):
                self._not_counted(CaptureError(
                    f"{type(self._traced).__name__}: a non-reentrant checkpoint() around the instrumented model stopped its "
                    "recompute early (torch's early stop): the part it ran is not counted; checkpoint inside the model, "
                    "or use use_reentrant=True or set_checkpoint_early_stop(False) around it"
                ), raising=False)
            raise
        if deferred is not None:  # strict: fxflops' own error, raised once the model ran without one of its own
            raise deferred
        if not measured:
            self._add(found, out, RECOMPUTED if recompute else "fwd")
        return out

    def _forget_failed_capture(self) -> None:
        """The model raised on this call: a capture that failed on it (the model's own ``assert``, a
        wrong feature size) says nothing of the calls that run, so its refusal is not kept."""
        failed, self._attempt.failed = self._attempt.failed, None
        if failed is None:
            return
        branch, refusal = failed
        with self._lock:
            if any(r is refusal for r in branch.refusals):
                branch.refusals = [r for r in branch.refusals if r is not refusal]
                branch.attempts = max(branch.attempts - 1, 0)

    def _compiled_forward(self, args: tuple, kwargs: dict) -> Any:
        args, kwargs, found = self._look_up_eagerly(args, kwargs)
        if found is not None and isinstance(found[0], Spine):
            self._not_counted_eagerly(CaptureError(
                f"{type(self._traced).__name__}: a measured call ({found[0].reasons}) is not counted inside torch.compile"
            ))
            found = None
        out = self._model(*args, **kwargs)
        self._add_eagerly(found, out)
        return out

    def _encoding_spine(self) -> Spine:
        """Where ``generate``'s encoding of images before the prefill is measured: every module."""
        spine = self.__dict__.get("_encoding")
        if spine is None:
            reason = "images and videos encoded by generate before the prefill, outside the forward"
            spine = self.__dict__["_encoding"] = Spine.whole(self._traced, reason)
        return spine

    def _measured(
        self, spine: Spine, forward: Callable[..., Any], args: tuple, kwargs: dict, phase: str = "fwd", own_call: bool = True
    ) -> Any:
        """Run a call of a measured situation (``fxflops/islands.py``) and add it whole, or not at all
        (``own_call=False``: part of a call, not one of its own)."""
        if self._model is not self._traced:  # a compiled module: its submodule calls are not routed
            self._not_counted(CaptureError(f"{type(self._traced).__name__}: a measured call is not counted through torch.compile"))
            return forward(*args, **kwargs)
        training = self._backward != "none" and torch.is_grad_enabled()
        try:
            call = MeasuredCall(self, spine, training)
        except Exception as exc:  # noqa: BLE001 - the fail-open boundary
            self._not_counted(exc)
            return forward(*args, **kwargs)
        out = call.run(forward, args, kwargs)
        try:
            call.counted(out, training and _requires_grad(out), phase, own_call)
        except Exception as exc:  # noqa: BLE001 - the fail-open boundary
            self._not_counted(exc)
        return out

    def child_counter(self, path: str, module: torch.nn.Module) -> Instrumented:
        """The wrapper counting the calls a measured call makes to the child module at ``path``: its
        own programs, on this wrapper's meter at that path; its capture failures are raised
        (``measure=False``) so that the measured call can measure inside it instead."""
        counter = self._children.get(path)
        if counter is None or counter._traced is not module:
            inside = {k[len(path) + 1 :]: v for k, v in (self._per_segment or {}).items() if k.startswith(path + ".")}
            counter = Instrumented(
                module, None, self._segments, inside or None, self._strict_metadata, self._backward, "recapture", self._strict,
                self._max_programs, self.flops, False, self._rules, measure=False, prefix=_joined(self._prefix, path),
            )
            self._children[path] = counter
        return counter

    @property
    def measured(self) -> dict[str, str]:
        """Modules whose own code is measured per call (their capture failed there), and why."""
        found: dict[str, str] = {}
        for branch in self._branches.values():
            for refusal in branch.refusals:
                if refusal.spine is not None:
                    found.update(refusal.spine.reasons)
        return found

    def _look_up(self, args: tuple, kwargs: dict, defer: bool = False) -> tuple:
        """The call as the model runs it, and its (program, symbol values), or None when it is not
        counted. Found (or captured) before the model runs, so a first call's routing is measured too.
        ``defer``: also return the error to raise once the model has run, else None: with ``strict``,
        a failed capture (the model's own exception, if the call raises one, comes first: an
        ``assert`` in its code may be why the trace failed)."""
        if not_a_microbatch():  # a pipeline stage inferring its shapes (capture/engines.py)
            return (args, kwargs, None, None) if defer else (args, kwargs, None)
        deferred = None
        try:
            transform = transform_around()
            if transform is not None:
                raise CaptureError(f"{type(self._traced).__name__}: called inside {transform}: its work is not what the call's sizes describe")
            args, kwargs = self._prepare(args, kwargs)
            found = self._program_for(args, kwargs)
            if self._routing is not None:
                self._routing.take()  # measurements of an earlier call that was not counted
        except Exception as exc:  # noqa: BLE001 - the one fail-open boundary (module docstring)
            found = None
            if defer and self._strict and isinstance(exc, CaptureError):  # the model's own error (an assert) may be why
                self.flops.not_counted()
                deferred = exc
            else:
                self._not_counted(exc)
        return (args, kwargs, found, deferred) if defer else (args, kwargs, found)

    def _add(self, found: tuple | None, out: Any, phase: str = "fwd") -> None:
        """Add the call's count to the meter (its backward too when one can follow; else its forward
        as ``phase``)."""
        if found is None:
            return
        try:
            training = self._backward != "none" and torch.is_grad_enabled() and _requires_grad(out)
            if found[0].binder.reads_values and any(isinstance(v, torch.Tensor) and v.is_meta for v in found[1]):
                raise MetadataError(f"{type(self._traced).__name__}: an input the count reads values of is on the meta device (no values)")
            program, monomials = found[0], self._monomials(*found)
            tensors = ([out] if isinstance(out, torch.Tensor) else output_tensors(out)) if training else []
            nodes = output_nodes(tensors)
            call = phase != RECOMPUTED  # a recompute is a call counted already
            if nodes:  # the forward now, the backward when (and each time) one runs from the outputs
                self.flops.add(program, monomials, False, prefix=self._prefix, phase=phase, call=call)
                roots = output_nodes(backward_roots(out, tensors)) or nodes  # what the traced backward starts from
                bill_backward(BackwardBill(self.flops, program, monomials, self._prefix, len(roots), self._warn_once), nodes, roots)
            else:
                self.flops.add(program, monomials, training and call, prefix=self._prefix, phase=phase, call=call)
            state = getattr(found[0], "state", None)
            if state is not None and not state.settled:  # after the call it was captured for (situation.py)
                state.settle()
        except Exception as exc:  # noqa: BLE001 - the one fail-open boundary
            self._not_counted(exc)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate`` (transformers), every forward it makes counted: the prompt's as
        phase ``prefill``, each later step's as ``decode`` (``fxflops/generation.py``); the tokens it
        produced are added to ``flops.generated_tokens``."""
        generate = self._traced.generate  # an AttributeError naming the model when it has none
        if getattr(getattr(self._traced, "config", None), "is_encoder_decoder", False):
            self._not_counted(CaptureError(
                f"{type(self._traced).__name__}.generate is not counted: an encoder-decoder model runs its encoder "
                "outside the forward (fxflops/generation.py)"
            ))
            return generate(*args, **kwargs)

        def count(phase: str, forward: Any, call_args: tuple, call_kwargs: dict) -> Any:
            if phase == ENCODE:  # images encoded before the prefill: measured, the prefill's work
                return self._measured(self._encoding_spine(), forward, call_args, call_kwargs, "prefill", own_call=False)
            compiling = torch.compiler.is_compiling()  # generate compiles decode steps with a static cache on GPUs
            look_up, add = (self._look_up_eagerly, self._add_eagerly) if compiling else (self._look_up, self._add)
            call_args, call_kwargs, found = look_up(call_args, call_kwargs)
            if found is not None and isinstance(found[0], Spine):
                if not compiling:
                    return self._measured(found[0], forward, call_args, call_kwargs, phase)
                found = None
            out = forward(*call_args, **call_kwargs)
            add(found, out, phase)
            return out

        state = None
        with contextlib.ExitStack() as stack:
            try:  # routing the model's own calls can fail only before generate starts: then run it uncounted
                state = stack.enter_context(counting_own_calls(self._traced, count))
            except Exception as exc:  # noqa: BLE001 - the fail-open boundary
                self._not_counted(exc)
            out = generate(*args, **kwargs)
        try:
            tokens = generated_tokens(self._traced, args, kwargs, out)
            if state is not None and state.calls == 0 and tokens:  # its forwards ran elsewhere: none counted
                raise CaptureError(
                    f"{type(self._traced).__name__}.generate produced {tokens} tokens through another model's forward "
                    "(a wrapper's generate handing over to the model it wraps): not counted; instrument that model"
                )
            self.flops.add_generated_tokens(tokens)
        except Exception as exc:  # noqa: BLE001 - the fail-open boundary
            self._not_counted(exc)
        return out

    _look_up_eagerly = torch.compiler.disable(_look_up)
    _add_eagerly = torch.compiler.disable(_add)

    def _not_counted_eagerly(self, exc: Exception) -> None:
        torch.compiler.disable(self._not_counted)(exc)

    def _raises(self, exc: Exception) -> bool:
        """Whether the user asked for ``exc`` to be raised rather than counted as uncounted."""
        return self._strict or (self._on_miss == "raise" and isinstance(exc, GuardError))

    def _not_counted(self, exc: Exception, raising: bool = True) -> None:
        """A call fxflops could not count: raise when asked to (and ``raising``: not where another
        exception is on its way), else count it as uncounted and warn once."""
        if raising and self._raises(exc):
            raise exc
        self.flops.not_counted()
        message = str(exc) if isinstance(exc, FxFlopsError) else f"internal error {type(exc).__name__}: {exc}"
        self._warn_once(message)

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call with the metadata the model family derives added (``fxflops/adapters/``): the
        model runs it (and skips deriving it), the program binds it. A failure leaves the call as is
        (the model's own code will raise it again, or the count fails open)."""
        try:
            return self._adapter.prepare(args, kwargs)
        except Exception as exc:
            if self._strict:
                raise
            self._warn_once(f"{type(self._traced).__name__}: could not derive metadata: {type(exc).__name__}: {exc}")
            return args, kwargs

    def _count(self, args: tuple, kwargs: dict, training: bool = False) -> None:
        """Count one (prepared) call without running the model."""
        program, values = self._program_for(args, kwargs)
        if isinstance(program, Spine):
            raise CaptureError(f"{type(self._traced).__name__}: this call is measured ({program.reasons}): it is counted only when it runs")
        self.flops.add(program, self._monomials(program, values), training)

    def _program_for(
        self, args: tuple, kwargs: dict, roots: tuple[int, ...] | None = None
    ) -> tuple[Program | Spine, tuple[int, ...] | None]:
        """The program of this call's situation whose model state and guards it meets, and its
        symbol values; captures a new one when none does (``on_miss``); raises FxFlopsError when
        it cannot. A situation whose capture failed in a module is measured there (``measure``):
        then (its :class:`Spine`, None). ``roots``: the output tensors a traced backward starts
        from (a measured call's child), part of the situation."""
        note_reparametrization()  # torch.func.functional_call swaps parameters unseen
        layout, modes = (len(args), tuple(kwargs), roots), mode_key()
        for check, traced_modes, program in self._recent.get(layout, ()):  # situations seen before: tested fast
            if traced_modes == modes and check(args, kwargs) and (program.state is None or program.state.matches()):
                try:
                    values = program.binder.values(args, kwargs)
                except InputError:  # MetadataError is raised
                    continue
                if program.within_guards(*values):
                    return program, values
        # else the general path finds (or captures) the program of this call's situation
        situation = (self._call_keys(args, kwargs), modes) + (() if roots is None else (roots,))
        branch = self._branches.get(situation)
        if branch is not None:
            program, found = branch.find(args, kwargs)
            if program is not None:
                self._remember(layout, situation, program, args, kwargs)
                return program, found
            measured = branch.refusal(_size_class(args, kwargs))
            if measured is not None and measured.spine is not None:
                return measured.spine, None
        with self._capturing():  # one capture per situation, also when two threads make its first call
            branch = self._branches.setdefault(situation, _Branch())
            program, miss = branch.find(args, kwargs)
            if program is not None:
                return program, miss
            sizes = _size_class(args, kwargs)
            refused = branch.refusal(sizes)
            if refused is not None and refused.spine is not None:
                return refused.spine, None
            if not branch.programs and self.programs:
                miss = self._nearest_difference(situation)
            name = type(self._traced).__name__
            if self.programs and self._on_miss == "raise":
                raise GuardError(f"{name}: {miss}")
            if len(self.programs) >= self._max_programs:
                reason = f"{name}: {miss}; already {len(self.programs)} programs (max_programs={self._max_programs}), not capturing another"
                if not self._measure:
                    raise GuardError(reason)
                return self._measured_whole(branch, sizes, reason, "max_programs", _MAX_PROGRAMS_ADVICE), None
            if refused is not None:
                if self._measure and branch.attempts >= MAX_ATTEMPTS and any(r.spine is not None for r in branch.refusals):
                    # measured in the states tried (a data-dependent line): measuring is exact in this one too
                    return self._measured_whole(branch, sizes, refused.reason, "attempts", _MEASURED_ADVICE), None
                raise CaptureError(refused.reason, module=refused.module)
            if self._measure and _lazy(self._traced):  # its first call makes its parameters: measured, then captured
                return Spine.whole(self._traced, f"{name} has parameters its first call makes (a lazy module)"), None
            if self._measure and _cached_parametrizations(self._traced):
                reason = f"{name}: its parametrized weights are computed once per torch.nn.utils.parametrize.cached() context"
                return self._measured_whole(branch, sizes, reason, "parametrize.cached", _MEASURED_ADVICE), None
            try:
                program = self._capture(branch, situation, sizes, args, kwargs, roots)
            except Exception as exc:
                self._attempt.failed = (branch, branch.refusals[-1])
                if not (self._measure and isinstance(exc, CaptureError) and (exc.module is not None or exc.in_trace)):
                    raise
                # measured where it failed; a trace failing where no module is named (a size torch's own
                # checks refuse symbolically: batch 0 in a training BatchNorm), from the root, at that size class
                branch.refusals[-1].spine = Spine(exc.module or "", branch.refusals[-1].reason)
                return branch.refusals[-1].spine, None
            if program.state is not None and not program.state.matches():  # what the capture could not see
                # the capture saw another state than the call's (an object a context variable holds, which a
                # capture's context does not: capture/ambient.py): its program serves the calls in that state
                reason = f"{name}: {program.state.mismatch()}: the capture could not see the state this call runs in"
                return self._measured_whole(branch, sizes, reason, reason, _MEASURED_ADVICE), None
        return program, program.binder.values(args, kwargs)

    @contextlib.contextmanager
    def _capturing(self) -> Iterator[None]:
        """Hold the capture lock. A call that reaches this wrapper again from the thread holding it
        (the model's code calling its own wrapper while it is captured or measured, a hook re-running
        the model) is refused, not left waiting for itself."""
        me = threading.get_ident()
        if self._lock_owner == me:
            raise FxFlopsError(f"{type(self._traced).__name__}: called again from inside its own capture (re-entrant call): not counted")
        with self._lock:
            self._lock_owner = me
            try:
                yield
            finally:
                self._lock_owner = None

    def _remember(self, layout: tuple, situation: tuple, program: Program, args: tuple, kwargs: dict) -> None:
        """Put ``program`` (found for this call's situation) first among those tested fast for calls of
        ``layout``: its situation's test generated from this call (once per situation and program;
        ``call_keys.py``), the last :data:`RECENT` kept. A program found fast is one the general
        path would accept too: its situation, model state and guards hold."""
        recent = self._recent.get(layout, ())
        if recent and recent[0][2] is program:
            return
        entry = next((e for e in recent if e[2] is program), None)
        if entry is None:
            check = self._call_keys.check(args, kwargs)
            if check is None:
                return
            entry = (check, situation[1], program)
        self._recent[layout] = (entry, *[e for e in recent if e is not entry][: RECENT - 1])

    def _nearest_difference(self, situation: tuple) -> str:
        """How this call's situation differs from the last captured one, in words."""
        traced = next(key for key, branch in reversed(self._branches.items()) if branch.programs)
        return f"no program for this call: {describe_difference(traced, situation)}"

    def _capture(
        self, branch: _Branch, situation: tuple, sizes: tuple, args: tuple, kwargs: dict, roots: tuple[int, ...] | None = None
    ) -> Program:
        """Capture this call as a new program of ``branch`` (in the call's own modes: a backward is
        traced when grad is enabled)."""
        started = time.perf_counter()
        rule = "none" if self._backward == "traced" and not torch.is_grad_enabled() else self._backward
        branch.attempts += 1
        try:
            program = build_program(
                self._traced, args, kwargs, self._adapter, dims=self._dims, per_segment=self._per_segment,
                segments=self._segments, strict_metadata=self._strict_metadata,
                backward=rule,
                allow_pins=bool(self.programs), rules=self._rules, situation=situation, roots=roots,
            )
        except Exception as exc:
            reason = str(exc) if isinstance(exc, FxFlopsError) else f"capture failed: {type(exc).__name__}: {exc}"
            module = exc.module if isinstance(exc, CaptureError) else None
            branch.refusals.append(_Refusal(sizes, self._refused_state(exc), reason, module))
            raise
        finally:
            self.flops.exclude_time(time.perf_counter() - started)  # capture time is not training time
        branch.attempts = 0
        branch.programs.append(program)
        self.captures += 1
        self.programs.append(program)
        if self._routing is not None:
            self._routing.watch(program.experts)
        return program

    def _measured_whole(self, branch: _Branch, sizes: tuple, reason: str, said: str, advice: str) -> Spine:
        """The calls of a situation that gets no program of its own (or none that fits it), measured
        whole: exact at every size, slower than a program (each op priced as it runs). Said once
        per ``said`` (a kind of reason) per wrapper, with ``advice``."""
        spine = Spine.whole(self._traced, reason)
        branch.refusals.append(_Refusal(sizes, None, reason, "", spine))
        if said not in self._warned:
            self._warned.add(said)
            warn(f"fxflops: {reason}: {advice}", stacklevel=5)
        return spine

    def _refused_state(self, exc: Exception) -> ModelState | None:
        """The model state a failed capture read up to its failure (``capture()`` attaches its reads):
        the refusal holds while the model stays in it."""
        reads = getattr(exc, "fxflops_reads", None)
        try:
            return ModelState(self._traced, *reads) if reads is not None else None
        except Exception:  # noqa: BLE001 - then the refusal holds in any state
            return None

    def _monomials(self, program: Program, values: tuple[int, ...]) -> tuple:
        """The call's monomials, with what the routing probes measured for MoE programs."""
        monomials = program.monomials(*values)
        if program.experts and self._routing is not None:
            if self._routing.errors:
                self._warn_once(f"routing not measured: {self._routing.errors.pop()}")
            return program.with_routing(monomials, self._routing.take())
        return monomials

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warn(f"fxflops: call not counted: {message}", stacklevel=4)


_STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class _Running(threading.local):
    """The meters (by id) whose counted calls are running the model in this thread."""

    meters: frozenset[int] = frozenset()


_RUNNING = _Running()


@contextlib.contextmanager
def _running(meter: Meter) -> Iterator[None]:
    before = _RUNNING.meters
    _RUNNING.meters = before | {id(meter)}
    try:
        yield
    finally:
        _RUNNING.meters = before


def _signature_source(model: torch.nn.Module) -> Any:
    """The forward whose signature the wrapper shows: the model's; for a model whose forward takes
    only ``*args, **kwargs`` and that wraps a base model (a PEFT model's ``get_base_model()``), the
    base model's, which is what the HF Trainer reads for a PEFT model to keep its dataset columns."""
    forward = model.forward
    try:
        kinds = {p.kind for p in signature_of(forward).parameters.values()}
        base = model.get_base_model() if hasattr(model, "get_base_model") else None
    except Exception:  # noqa: BLE001 - a signature is a courtesy to frameworks
        return forward
    if kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} and isinstance(base, torch.nn.Module) and base is not model:
        return base.forward
    return forward


def _with_signature(method: Any, model_forward: Any) -> Any:
    """A copy of ``method`` (``self, *args, **kwargs``) whose signature is ``self`` + the model's."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    signature = signature_of(model_forward)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    forward.__doc__ = getattr(model_forward, "__doc__", None)
    return forward


def _joined(prefix: str, path: str) -> str:
    return ".".join(p for p in (prefix, path) if p)


def _requires_grad(out: Any) -> bool:
    """True if any tensor in the output requires grad (so a backward can follow this forward). An
    output hiding tensors (an iterator, a generator, whose tensors exist only once consumed; objects
    nested too deep: ``output_tensors``): whether a backward follows cannot be seen, so such a call
    is refused (FxFlopsError), never counted as a forward."""
    if isinstance(out, torch.Tensor):
        return out.requires_grad
    hidden: list[str] = []
    tensors = output_tensors(out, hidden)
    if hidden:
        raise FxFlopsError(f"{hidden[0]}: whether a backward follows this call cannot be seen")
    return any(t.requires_grad for t in tensors)


def instrument(
    model: torch.nn.Module,
    *,
    dims: dict[str, dict[int, str]] | None = None,
    segments: dict[str, str] | None = None,
    per_segment: dict[str, str] | None = None,
    strict_metadata: bool = False,
    backward: bool | str = False,
    on_miss: str = "recapture",
    strict: bool = False,
    max_programs: int = 16,
    meter: Meter | None = None,
    measure_routing: bool = False,
    rules: Mapping[Any, Any] | None = None,
    measure: bool = True,
) -> Instrumented:
    """Wrap ``model`` so every call adds its FLOPs to ``wrapper.flops`` (see module docstring).

    ``dims``, ``segments``, ``per_segment``, ``strict_metadata`` and ``backward`` as for
    :func:`fxflops.trace` (``dims=None``: every input dim free unless the code pins it; segment
    families found automatically). With ``backward``, a call made with grad enabled whose output
    requires grad is captured with its backward; its forward is counted when it runs, its backward
    (and recompute) when a backward reaches its outputs: once per backward pass, each pass (a
    retained graph), never when none runs (an evaluation left in grad mode). The traced backward
    starts from the loss or every floating output; a backward from some of them, or to some inputs
    only (``autograd.grad(loss, x)``, ``backward(inputs=...)``), runs less than it: not counted, and
said (``torch.autograd.grad`` is, even for every leaf: torch does not tell which leaves it asks). A
    measured call's symbolic children and calls through ``torch.compile`` bill their backward with
    the forward. A forward under ``torch.no_grad()`` is its own situation, captured and counted as a
    forward.

    ``meter`` shares one Meter between several wrappers: the pipeline stages or virtual-pipeline chunks
    a rank runs, each instrumented on its own, count every layer once however the schedule interleaves
    their microbatches.

    ``measure_routing`` wraps the expert modules of mixture-of-experts programs so that each call also
    measures the FLOPs its dispatch really computed (``fxflops/routing.py``), which the ``moe="actual"``
    convention reports; without it only ``moe="model"`` (top_k × tokens) is available.

    ``max_programs`` bounds the programs (situations and guard branches) captured per wrapper; a call
    that would need another is measured whole, op by op (exact, slower; with ``measure=False`` it is
    refused as uncounted).
    ``rules`` as for :func:`fxflops.trace`: per-use FLOPs rules, for every capture of this wrapper (and
    its routing measurements), the global registry untouched.

    ``measure``: a call whose capture fails inside a module (a loop over ``image_sizes``, a slice
    bounded by tensor values, ``if mask.any():``) is counted by measuring that module's own code and
    its ancestors' per call, each of their children that traces counted by its own symbolic program
    (``fxflops/islands.py``; ``wrapper.measured`` names the modules and the lines). ``measure=False``
    refuses such calls instead (counted as uncounted, with the reason).
    """
    return Instrumented(
        model, dims, segments, per_segment, strict_metadata, backward, on_miss, strict, max_programs, meter,
        measure_routing, rules, measure,
    )
