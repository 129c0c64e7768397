"""Call situations: everything a program's count depends on besides the sizes its symbols carry.

A program is exact for the call it was traced from and for every call *in the same situation* whose
sizes meet its guards. The situation has three parts, checked on every counted call:

- :class:`~fxflops.call_keys.CallKeys` (``fxflops/call_keys.py``): the call itself besides the sizes the binder reads — which arguments are given
  (positionally or by keyword), which are ``None``; each tensor's type, dtype, device,
  ``requires_grad`` and rank; the value of every Python scalar, string, enum, dtype or device;
  containers by structure; other objects (a cache, a config passed in) by type and contents, their
  tensors as inputs too (without sizes: those are symbols the binder reads, so one decode program
  serves every length of a key-value cache) and their classes' plain defaults, which input tensors
  are one object. Functions by code and closure; a module passed in by what it holds.
- :func:`mode_key`: grad mode, inference mode, autocast (per device type: enabled, dtype, cache), the
  scaled-dot-product-attention backends enabled, the MHA fast path, the default dtype, deterministic
  algorithms, checkpointing's early stop.
- :class:`ModelState`: the model's state the trace depended on (``capture/reads.py`` recorded what it
  read): ``training`` flags and every other plain attribute the trace read from a module or from an
  object a module holds (``config._attn_implementation``; a list, dict or set the model's code or
  hooks only fill in place, ``self.records.append(...)``, by identity: ``situation_code.code_reads``; what
  a hook object sets on itself only to keep count, ``self.calls += 1``, not at all, unless its code
  also reads it otherwise: ``situation_code.attributes_read_beyond_updates``), the
  globals and closure values the code the trace ran reads (``fxflops/situation_code.py``), whether
  each ``functools.lru_cache`` whose work the trace counted is empty (``capture/side_effects.py``:
  the trace computed on a miss), which parameters require grad (programs
  traced with grad enabled, and those whose code reads ``requires_grad``), and the model's structure: the identity of every module, parameter and
  buffer, their shapes, dtypes and devices, and the number of hooks. The modules a module holds
  without registering them (a distillation teacher in ``__dict__``, modules in a dict attribute:
  ``capture/reads.py``'s ``named_modules``) are the model's here as the registered ones are.

The first two are tuples compared as dictionary keys (a call in a situation seen before is
recognised by generated tests instead, without building its key: ``CallKeys.check``). The model state is a generated Python function
over the recorded attributes (tens of nanoseconds per attribute); the structure, whose full check
walks every module, is re-checked only after something was registered on any module anywhere (module,
parameter and buffer assignments fire torch's global registration hooks, counted by
:data:`STRUCTURE`; a hook registered anywhere moves torch's hook handle counter), and after every
``Meter.step()`` (what no hook sees: ``param.data = ...``); a module hook removed is found at the
next call by the size of the hook dicts that held hooks. A call in another situation gets its own
program, or a clear refusal.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.utils.stateless
import torch.nn.utils.parametrize as _parametrize
import torch.utils.checkpoint as _checkpoint
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from fxflops.analysis.paths import inside, moved
from fxflops.call_keys import ALIASED, SCALARS, described_layout, value_key
from fxflops.capture.reads import HELD_DEPTH, HOOK_DICTS, Reads, attribute, hook_at, hook_objects, library_module, module_at, named_modules
from fxflops.errors import InputError
from fxflops.situation_code import (
    MAX_COMPARED, METHODS, TORCH_BASES, CodeRead, SamePartial, ThroughClass, attributes_read_beyond_updates, code_reads,
    copied, definition, importable, namespace_id, plain,
)


def _autocast_key() -> tuple:
    return (torch.is_autocast_cache_enabled(),) + tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda", "xpu", "mps", "hpu")
        if _autocast_enabled(device)
    )


def _autocast_enabled(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type this build does not know
        return False


_grad, _inference, _any_autocast = torch.is_grad_enabled, torch.is_inference_mode_enabled, torch._C._is_any_autocast_enabled
_sdpa = (torch._C._get_flash_sdp_enabled, torch._C._get_mem_efficient_sdp_enabled, torch._C._get_math_sdp_enabled, torch._C._get_cudnn_sdp_enabled)
_fastpath, _default_dtype = torch.backends.mha.get_fastpath_enabled, torch.get_default_dtype
_deterministic = torch._C._get_deterministic_algorithms


def mode_key() -> tuple:
    """Grad, inference and autocast modes, SDPA backends, MHA fast path, default dtype,
    deterministic algorithms (model code may pick another implementation under them),
    checkpointing's early stop as ``set_checkpoint_early_stop`` sets it (a non-reentrant
    checkpoint's recompute runs to the end of its region without it) and parametrizations'
    cache (``torch.nn.utils.parametrize.cached()``: a parametrized weight computed once per
    context, its later reads free)."""
    flash, efficient, math_, cudnn = _sdpa
    return (
        _grad(),
        _inference(),
        _autocast_key() if _any_autocast() else None,
        flash(),
        efficient(),
        math_(),
        cudnn(),
        _fastpath(),
        _default_dtype(),
        _deterministic(),
        _checkpoint._enable_checkpoint_early_stop,
        _parametrize._cache_enabled > 0,
    )


_MODE_NAMES = ("grad mode", "inference mode", "autocast", "flash SDPA", "memory-efficient SDPA", "math SDPA",
               "cuDNN SDPA", "MHA fast path", "default dtype", "deterministic algorithms",
               "checkpoint early stop (set_checkpoint_early_stop)")


def describe_difference(traced: tuple, now: tuple) -> str:
    """What differs between two situations ``(call key, mode key)``, in words; a measured call's
    child adds the output leaves its backward starts from (``fxflops/islands.py``)."""
    call_a, mode_a, *roots_a = traced
    call_b, mode_b, *roots_b = now
    if roots_a != roots_b:
        return f"the backward starts from output leaves {roots_b or 'by default'}, the program was traced from {roots_a or 'the default'}"
    for name, a, b in zip(_MODE_NAMES, mode_a, mode_b):
        if a != b:
            return f"{name} is {_shown(b)}, the program was traced with {_shown(a)}"
    given_a, given_b = dict(call_a), dict(call_b)
    differences = [
        _aliasing_difference(given_a.get(name), given_b.get(name)) if name == ALIASED
        else f"argument {name!r} is {_described(given_b.get(name))}, the program was traced with {_described(given_a.get(name))}"
        for name in [*given_a, *(n for n in given_b if n not in given_a)]
        if given_a.get(name) != given_b.get(name)
    ]
    shown = "; ".join(differences[:4]) + (f"; and {len(differences) - 4} more" if len(differences) > 4 else "")
    return shown or "the call differs from the traced one"


def _aliasing_difference(traced: tuple | None, now: tuple | None) -> str:
    """Which input tensors are one object (``call_keys.aliases``: positions in the order the call's
    arguments hold them), now and when traced, in words."""
    def said(groups: tuple | None) -> str:
        if not groups:
            return "every input tensor distinct"
        return "; ".join(f"input tensors {' and '.join(f'#{i}' for i in group)} one object" for group in groups)
    return f"this call has {said(now)}, the program was traced with {said(traced)}"


def _shown(value: Any) -> str:
    return {True: "on", False: "off", None: "off"}.get(value, str(value)) if isinstance(value, (bool, type(None))) else str(value)


def _described(key: Any) -> str:
    """A value key in words."""
    if key is None:
        return "absent"
    kind = key[0]
    if isinstance(kind, type) and issubclass(kind, torch.Tensor):
        layout = "" if len(key) < 6 else f", {described_layout(key[5])}"
        if len(key) > 6 and key[6] is not None:
            layout += f", Python attributes {', '.join(name for name, _ in key[6])}"
        return f"a {kind.__name__} ({key[1]}, {key[2]}, requires_grad={key[3]}, rank {key[4]}{layout})"
    if kind is type(None):
        return "None"
    if len(key) == 2 and isinstance(kind, type) and issubclass(kind, SCALARS):
        return repr(key[1])
    return f"a {getattr(kind, '__name__', kind)} with other contents"


class Structure:
    """A count of registrations on the modules of instrumented models (torch's global module,
    parameter and buffer registration hooks, filtered to those modules), plus one per
    ``Meter.step()``, plus one whenever a hook was registered anywhere (torch's hook handle counter,
    ``RemovableHandle.next_id``, moved): when it moves, model structures are re-checked.
    Registrations on other modules (HF decoders slice their ``ModuleList`` on every forward, building
    a new one) do not count. Hook handles made on most calls (a module with full backward hooks
    registers tensor hooks at every call; FlopCounterMode its global hooks at every use) would make
    every call a re-check: after :data:`USELESS_RECHECKS` re-checks that a handle caused and that
    found nothing changed, handles are no longer followed (a hook added is then found at the next
    ``Meter.step()``). A hook removed (``handle.remove()``) moves no counter: each model state checks
    the sizes of the module hook dicts that held hooks (``ModelState._take_hook_counts``)."""

    USELESS_RECHECKS = 64

    def __init__(self) -> None:
        self._version = 0
        self._installed = False
        self._tracked: dict[int, weakref.ref] = {}  # by id: a module class may define __eq__ without __hash__
        self._handles = RemovableHandle.next_id
        self._by_handle = False  # the last move came from a hook handle
        self.useless = 0  # re-checks a handle caused that found nothing changed
        self.following_handles = True

    @property
    def version(self) -> int:
        """The count now (one attribute load more than a plain counter while handles are followed)."""
        if self.following_handles and RemovableHandle.next_id != self._handles:
            self._handles = RemovableHandle.next_id
            self._version += 1
            self._by_handle = True
        return self._version

    def found_unchanged(self) -> None:
        """A re-check found the structure as it was: a handle made it in vain."""
        if self._by_handle:
            self.useless += 1
            self.following_handles = self.useless < self.USELESS_RECHECKS

    def track(self, model: torch.nn.Module) -> None:
        """Count registrations on ``model``'s modules from now on."""
        if not self._installed:
            nn_module.register_module_module_registration_hook(self._registered)
            nn_module.register_module_parameter_registration_hook(self._registered)
            nn_module.register_module_buffer_registration_hook(self._registered)
            self._installed = True
        for _, m in named_modules(model):
            if self._tracked.get(id(m), _dead)() is not m:
                self._tracked[id(m)] = weakref.ref(m, functools.partial(self._forget, id(m)))

    def _forget(self, key: int, ref: weakref.ref) -> None:
        if self._tracked.get(key) is ref:
            del self._tracked[key]

    def _registered(self, module: torch.nn.Module, name: str, value: Any) -> None:
        """torch's hook for every registration in the process: never raises into the user's code."""
        ref = self._tracked.get(id(module))
        if ref is not None and ref() is module:
            self._version += 1
            self._by_handle = False

    def bump(self) -> None:
        self._version += 1
        self._by_handle = False

    def own_handles(self, before: int, made: int) -> None:
        """fxflops made ``made`` hook handles since the handle counter was ``before`` (a backward
        bill's hooks on a call's autograd nodes, on every training call): when no other handle was
        made meanwhile and none before since the last look, the count does not move for them (else
        every training call would be a re-check, and after :data:`USELESS_RECHECKS` of them handles
        would no longer be followed: a hook added later would go unseen)."""
        if self._handles == before and RemovableHandle.next_id == before + made:
            self._handles = RemovableHandle.next_id


class _Signature:
    """What a model structure's changes that fire no registration hook alter, tested on every call
    at C speed (tens of nanoseconds per module): each module's class (``module.__class__ = Other``),
    an instance-level ``forward`` (``module.forward = wrapped``), the children of each module that
    has children, by contents (``del layers[1]``, ``layers.pop(0)``, ``module._modules[name] = m``;
    ``ModuleList`` deletion makes its dict anew), and the number of torch's global module hooks (one
    removed moves no counter). When it changes, :meth:`ModelState.matches` walks the whole structure
    (``_snapshot``) and takes the signature again. Not seen here: a tensor resized in place
    (``param.data = ...``) or written into a parameter dict directly, a child put directly into a
    leaf's empty children dict; found at the next ``Meter.step()``."""

    __slots__ = ("modules", "dicts", "types", "forwards", "parents", "children", "hooks")

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = modules
        self.dicts = [vars(m) for m in modules]
        self.types = list(map(type, modules))
        self.forwards = list(map(dict.get, self.dicts, itertools.repeat("forward")))
        self.parents = [d for d in self.dicts if d.get("_modules")]
        self.children = [dict(d["_modules"]) for d in self.parents]  # copies: a dict changed in place differs
        self.hooks = _global_hook_counts()

    def holds(self) -> bool:
        try:
            return (
                list(map(type, self.modules)) == self.types
                and list(map(dict.get, self.dicts, itertools.repeat("forward"))) == self.forwards
                and list(map(_CHILDREN, self.parents)) == self.children
                and _global_hook_counts() == self.hooks
            )
        except KeyError:  # a module's children dict deleted
            return False


_CHILDREN = operator.itemgetter("_modules")
_GLOBAL_HOOKS = (
    nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks,
    nn_module._global_backward_pre_hooks, nn_module._global_backward_hooks,
)


def _global_hook_counts() -> tuple[int, ...]:
    return tuple(map(len, _GLOBAL_HOOKS))


def _hook_ids(*hook_dicts: Any) -> tuple:
    """The hooks of each dict by identity (a hook replaced by another one is another structure)."""
    return tuple(tuple(map(id, hooks.values())) if hooks else () for hooks in hook_dicts)


def _not_torchs(hooks: dict) -> dict:
    """The global module hooks that are not torch's own tools' (FlopCounterMode's module tracker
    registers its global hooks on entering and removes them on leaving; they compute nothing): a
    user's FlopCounterMode around a first call is not part of the structure that call was traced in."""
    return {k: h for k, h in hooks.items() if not (getattr(getattr(h, "__func__", h), "__module__", None) or "").startswith("torch.")}


def _dead() -> None:
    return None


STRUCTURE = Structure()

_FUNCTIONAL_CALL = torch.nn.utils.stateless._functional_call.__code__  # what torch.func.functional_call runs


class _Reparametrized(threading.local):
    inside = False  # this thread's last lookup was made inside torch.func.functional_call


_REPARAMETRIZED = _Reparametrized()


def note_reparametrization(depth: int = 16) -> None:
    """``torch.func.functional_call`` puts other tensors in a module's parameter and buffer dicts for
    one call (MAML's fast weights, a wider weight), writing the dicts directly: no registration hook
    fires. A call made inside it, and the first one after it, re-check model structures (a bump of
    :data:`STRUCTURE`). Found by the frames of the calling thread, ``depth`` deep."""
    frame, inside = sys._getframe(1), False
    for _ in range(depth):
        if frame is None:
            break
        if frame.f_code is _FUNCTIONAL_CALL:
            inside = True
            break
        frame = frame.f_back
    if inside or _REPARAMETRIZED.inside:
        STRUCTURE.bump()
    _REPARAMETRIZED.inside = inside


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
@dataclass(frozen=True)
class StateGuard:
    """One attribute of the traced state: ``key`` of the module at ``path`` (or of the object that
    module holds along the dotted attribute path ``held``) compared with ``expected`` by ``test``:
    ``"value"`` (a tensor whose value the trace read, ``int(self.reps)``: the same tensor, its version
    counter unchanged, no sync), ``"is"`` (flags, None,
    objects such as a config), ``"=="`` (numbers, strings, small containers of them), ``"shapes"``
    (tensors, and containers of them, that the trace used as constants: :func:`value_key` with
    shapes) or ``"key"`` (tensors it only read, e.g. compared with None: by type, dtype, device,
    rank; a cache the model's own forward rewrites, such as Qwen2-VL's ``rope_deltas``, keeps its
    program across batch sizes).

    ``where`` says whose attribute it is: ``"instance"`` (the object's ``__dict__``), ``"class"`` (read
    on the object, found on its class: ``Block.use_gate = False`` read as ``self.use_gate``, a method
    such as ``forward`` that a library may patch on the class; holds while the object's class and the
    classes before it in the MRO resolve the name to the same value) or ``"absent"`` (not in the
    object's ``__dict__``: read there and found on the class, or not at all, as in
    ``getattr(self, "extra", 0)`` or ``hasattr(self, "tail")``; holds while the object still has no such
    instance attribute) or ``"computed"`` (held by neither: its class resolves the name itself, an
    alias of a transformers config's ``attribute_map``, a dict behind ``__getattr__``; read with
    ``getattr`` per call)."""

    label: str
    path: str
    held: str | None
    key: str
    expected: Any
    test: str
    where: str = "instance"

    def holds(self, value: Any) -> bool:
        if self.test == "value":
            return value is self.expected[0] and value._version == self.expected[1]
        if self.test == "is":
            return value is self.expected
        if self.test == "==":
            return value == self.expected
        return value_key(value, self.test == "shapes") == self.expected

    def owner(self, model: torch.nn.Module) -> Any:
        """The object holding the attribute (KeyError/AttributeError when gone)."""
        owner = module_at(model, self.path)
        for name in self.held.split(".") if self.held is not None else ():
            owner = hook_at(owner, name) if "#" in name else vars(owner)[name]  # a hook object (capture/reads.py)
        return owner

    def namespaces(self, model: torch.nn.Module) -> tuple[Any, tuple[Any, ...]]:
        """(the namespace the guard reads ``key`` from, the namespaces that must not define it):
        the owner's ``__dict__``; for a class attribute, the ``__dict__`` of the class that resolves it
        now and those of the classes before it in the MRO (a subclass that defines it meanwhile
        shadows it; the owner's own ``__dict__`` is an ``"absent"`` guard of its own)."""
        owner = self.owner(model)
        if self.where != "class":
            return vars(owner), ()
        mro = type(owner).__mro__
        at = next((i for i, cls in enumerate(mro) if self.key in vars(cls)), 0)
        return vars(mro[at]), tuple(vars(cls) for cls in mro[:at])


class ModelState:
    """The model state a program was traced in (see the module docstring): ``matches()`` per call,
    ``mismatch()`` says what changed.

    ``reads`` are the capture's recorded reads, ``copies`` maps the path of every layer billed as a
    copy of a traced one to that layer's path, ``grad`` says whether the trace ran with grad enabled
    (then which parameters require grad is part of the state), ``constants`` are the ids of the real
    tensors the trace used as constants. Guards are kept by module path, so a
    copied or loaded program binds them to its own model again."""

    def __init__(
        self, model: torch.nn.Module, reads: Reads, copies: dict[str, str], grad: bool, constants: set[int] = frozenset()
    ) -> None:
        self.model = model
        self.called = {path: set(reads.of_module(m)) for path, m in named_modules(model) if reads.of_module(m)}
        self.called.update(_held_reads(model, reads))  # the methods of the objects the modules hold run too
        self.functions = reads.functions  # the call's function arguments: their globals are read too
        code = code_reads(model, self.called, self.functions)  # globals and closures of the code the trace ran
        self.guards = _guards_from(model, reads, copies, constants, code.filled, code.counters)
        # which parameters require grad: a traced backward's, or a forward's whose code reads it
        self.requires_grad = {n: p.requires_grad for n, p in model.named_parameters()} if grad or code.reads_requires_grad else {}
        self.memos = list(reads.memos.values())  # lru caches whose work the trace did: (cache, empty then)
        self._bind(code.code)

    def _bind(
        self, code: list[CodeRead] | None = None, traced: dict[str, Any] | None = None, definitions: dict[str, Any] | None = None
    ) -> None:
        """Generate the per-call check against this model's objects and take its structure (``code``:
        the code reads, found again when not given: a copy's or a loaded program's own objects, with
        the plain values of ``traced``, by label, as they were traced; a function found whose
        :func:`definition` is not the traced one's in ``definitions`` is compared with that definition)."""
        STRUCTURE.track(self.model)
        scope: dict[str, Any] = {"_any": torch._C._any_requires_grad, "_key": value_key, "_getattr": getattr}
        tests = []
        absent: dict[int, tuple[Any, set[str]]] = {}  # id(object) -> (object, names its __dict__ must not hold)
        for i, guard in enumerate(self.guards):
            if guard.where == "computed":  # read as the code reads it: through the class's own lookup
                scope[f"_r{i}"], scope[f"_v{i}"] = guard.owner(self.model), guard.expected
                tests.append(f"_getattr(_r{i}, {guard.key!r}) {guard.test} _v{i}")
                continue
            namespace, shadows = guard.namespaces(self.model)
            if guard.where == "absent":
                owner = guard.owner(self.model)
                absent.setdefault(id(owner), (owner, set()))[1].add(guard.key)
                continue
            if guard.expected is _AsLoaded:
                now = namespace.get(guard.key)
                guard = self.guards[i] = dataclasses.replace(guard, expected=(now, now._version) if guard.test == "value" else now)
            scope[f"_d{i}"], scope[f"_v{i}"] = namespace, guard.expected
            got = f"_d{i}[{guard.key!r}]"
            for j, shadow in enumerate(shadows):  # a subclass must not define it meanwhile
                scope[f"_s{i}_{j}"] = shadow
                tests.append(f"{guard.key!r} not in _s{i}_{j}")
            if guard.test == "value":  # the same tensor, not written in place since (its version counter)
                scope[f"_v{i}"], scope[f"_w{i}"] = guard.expected
                tests.append(f"{got} is _v{i} and _v{i}._version == _w{i}")
            elif guard.test in ("key", "shapes"):
                tests.append(f"_key({got}, {guard.test == 'shapes'}) == _v{i}")
            else:
                tests.append(f"{got} {guard.test} _v{i}")
        for k, (owner, names) in enumerate(absent.values()):  # one test per object: its class, its names at once
            scope[f"_o{k}"], scope[f"_t{k}"], scope[f"_a{k}"], scope[f"_n{k}"] = owner, type(owner), vars(owner).keys(), frozenset(names)
            tests.append(f"type(_o{k}) is _t{k} and _a{k}.isdisjoint(_n{k})")
        if code is None:  # a copy's or a loaded program's own objects; the plain values as traced
            traced, definitions = traced or {}, definitions or {}
            code = [
                dataclasses.replace(read, expected=traced[read.label]) if read.label in traced
                else dataclasses.replace(read, expected=_TracedDefinition(read.label, definitions[read.label]), test="==")
                if read.label in definitions and definition(read.expected) != definitions[read.label]
                else read
                for read in code_reads(self.model, self.called, self.functions).code
            ]
        self.code = code
        tests += _code_tests(self.code, scope)
        parameters = dict(self.model.named_parameters())
        frozen = tuple(parameters[n] for n, wanted in self.requires_grad.items() if not wanted)
        if frozen:
            scope["_frozen"] = frozen
            tests.append("not _any(*_frozen)")
        for k, (cache, empty) in enumerate(self.memos):  # empty or not, as when traced (situation_code.py)
            scope[f"_m{k}"] = cache
            tests.append(f"(_m{k}.cache_info().currsize == 0) is {empty}")
        for i, name in enumerate(n for n, wanted in self.requires_grad.items() if wanted):
            scope[f"_p{i}"] = parameters[name]
            tests.append(f"_p{i}.requires_grad")
        operands = ", ".join(f"{name}={name}" for name in scope)  # bound as defaults: fast local loads
        lines = [f"def check({operands}):"]
        for chunk in _chunks(tests, 64):
            lines.append(f"    if not ({' and '.join(chunk)}): return False")
        lines.append("    return True")
        exec(compile("\n".join(lines) + "\n", "<fxflops model state>", "exec"), scope)  # noqa: S102 - our own code
        self._check: Callable[[], bool] = scope["check"]
        self._structure, hooks, modules = self._snapshot()
        self._take_hook_counts(hooks)
        self._signature = _Signature(modules)
        self._version = STRUCTURE.version
        self._structure_ok = True
        self.settled = False

    def settle(self) -> None:
        """Take the module hooks again after the first real call the program counted (the call it
        was captured for): hooks that call's own code registered on the real modules (transformers
        installs its output-capturing hooks on the first forward; the trace did the same on its twin)
        are the structure the program was traced with, not a change after it. Only hooks: modules,
        parameters and buffers as they were before the call (FSDP2 leaves the root's parameters
        unsharded after a forward, sharded again before the next)."""
        self.settled = True
        now, hooks, modules = self._snapshot()
        if len(now) != len(self._structure):
            return
        settled = [now[0]]  # the global hooks
        for before, after in zip(self._structure[1:], now[1:]):
            if before[:4] != after[:4] or before[5] != after[5]:  # anything but the module's hooks
                return
            settled.append(after)
        self._structure = tuple(settled)
        self._take_hook_counts(hooks)
        self._signature = _Signature(modules)

    def _take_hook_counts(self, hooks: tuple[dict, ...]) -> None:
        """The model's module hook dicts holding hooks now (``_snapshot``'s) and their sizes: a hook
        removed (``handle.remove()``, which moves no counter) is found at the next call by its dict's
        size. A hook added where there was none moves the handle counter. Not the global hook dicts:
        tools (FlopCounterMode's module tracker, profilers) add and remove theirs around a call."""
        self._hooks = hooks
        self._hook_counts = tuple(map(len, hooks))

    def _snapshot(self) -> tuple[tuple, tuple[dict, ...], list[torch.nn.Module]]:
        """Every module, parameter and buffer by identity (tensors with shape, dtype, device and
        their gradient hooks), the hooks and forward overrides: the structure the program was traced
        on; the modules' hook dicts that hold hooks (``_take_hook_counts``); the modules."""
        rows: list[Any] = [_hook_ids(*map(_not_torchs, _GLOBAL_HOOKS))]
        held: list[dict] = []
        modules = named_modules(self.model)
        for path, m in modules:
            tensors = tuple(
                (name, id(t), t.dtype, tuple(t.shape), t.device, _hook_ids(t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)))
                if t is not None else (name, None)
                for name, t in itertools.chain(m._parameters.items(), m._buffers.items())
            )
            dicts = tuple(getattr(m, name) for name in HOOK_DICTS)
            held += [d for d in dicts if d]
            hooks = _hook_ids(*dicts)
            forward = vars(m).get("forward")  # an instance-level override (not fxflops' own routing probe)
            overridden = forward is not None and not getattr(forward, "fxflops_own", False)
            rows.append((path, id(m), type(m), tensors, hooks, id(forward) if overridden else None))
        return tuple(rows), tuple(held), [m for _, m in modules]

    def matches(self) -> bool:
        """Whether the model is in the state the program was traced in."""
        version = STRUCTURE.version
        if version != self._version or not self._signature.holds():
            self._version = version
            now, hooks, modules = self._snapshot()
            ok = now == self._structure
            if ok:
                self._take_hook_counts(hooks)  # the same hooks, maybe in dicts made anew
                if self._structure_ok:
                    STRUCTURE.found_unchanged()
            self._signature = _Signature(modules)  # of the structure found: a changed one is not walked again per call
            self._structure_ok = ok
        if not self._structure_ok or tuple(map(len, self._hooks)) != self._hook_counts:
            return False
        try:
            return self._check()
        except Exception:  # noqa: BLE001 - a read the trace made fails now (deleted, a cell emptied, a lookup raising): not that state
            return False

    def mismatch(self) -> str:
        """What differs from the traced state, in words ("" when nothing does)."""
        if self._snapshot()[0] != self._structure:
            return f"the structure of {type(self.model).__name__} changed (a module, parameter, buffer or hook)"
        for guard in self.guards:
            if guard.where == "computed":
                now = getattr(guard.owner(self.model), guard.key, _MISSING)
                if not guard.holds(now):
                    return f"{guard.label} is {_short(now)}, the program was traced with {_short(guard.expected)}"
                continue
            state, shadows = guard.namespaces(self.model)
            if guard.where == "absent":
                if guard.key in state:
                    return f"{guard.label} is {_short(state[guard.key])}, the program was traced without it"
                continue
            if guard.key not in state or any(guard.key in shadow for shadow in shadows):
                return f"{guard.label} was deleted or redefined on a subclass"
            now = state[guard.key]
            if not guard.holds(now):
                return f"{guard.label} is {_short(now)}, the program was traced with {_short(guard.expected)}"
        for read in self.code:
            if not read.holds():
                return f"{read.label} changed since the program was traced"
        for cache, empty in self.memos:
            if (cache is None or cache.cache_info().currsize == 0) is not empty:
                state = "unknown (not saved)" if cache is None else "empty" if not empty else "filled"
                return f"the lru cache of {getattr(cache, '__qualname__', 'a function')} is {state}, the program was traced with it {'empty' if empty else 'filled'}"
        for name, p in self.model.named_parameters():
            if name in self.requires_grad and p.requires_grad != self.requires_grad[name]:
                return f"parameter {name!r} has requires_grad={p.requires_grad}, the program was traced with {self.requires_grad[name]}"
        return ""

    def __getstate__(self) -> dict:
        # a class attribute's value (a method, a property) is the class's own: taken again on load
        guards = [
            dataclasses.replace(g, expected=_AsLoaded)
            if g.test == "value" or g.test == "is" and (g.where == "class" or isinstance(g.expected, _FILLED))
            else g
            for g in self.guards
        ]
        functions = [f for f in self.functions if importable(f)]  # a lambda argument's reads are not saved
        memos = [(cache if importable(cache) else None, empty) for cache, empty in self.memos]  # None: never matches
        # a plain value the code read (a flag, a number, a torch setting) as traced: a copy or a load made
        # after it changed must not take the new value as the traced one (identities are taken again)
        traced = {read.label: read.expected for read in self.code if _saved_as_traced(read)}
        # a function it read is found again, but must be the one traced: a helper replaced since is not
        definitions = {read.label: found for read in self.code if (found := definition(read.expected)) is not None}
        return {
            "model": self.model, "guards": guards, "called": self.called, "functions": functions, "requires_grad": self.requires_grad,
            "memos": memos, "traced_code_values": traced, "traced_definitions": definitions,
        }

    def __setstate__(self, state: dict) -> None:
        traced, definitions = state.pop("traced_code_values", {}), state.pop("traced_definitions", {})
        self.__dict__.update({"functions": [], "memos": [], **state})
        self._bind(traced=traced, definitions=definitions)  # the copy's own objects: identities do not survive a copy


def _saved_as_traced(read: CodeRead) -> bool:
    """Whether a code read's expected value is kept as traced by a copy or a saved program: plain
    values compared by value (small containers of them: a copy), and flags and None (compared by
    identity, which they keep)."""
    if read.test == "is":
        return isinstance(read.expected, (bool, type(None)))
    return plain(read.expected, MAX_COMPARED)


def _code_tests(reads: list[CodeRead], scope: dict[str, Any]) -> list[str]:
    """Tests that the values the model's code reads are as traced: the globals of one module at once
    (``itemgetter``: one C call), the closure cells as one tuple, each compared with ``==`` (identity
    first: a function is equal only to itself)."""
    by_namespace: dict[int, tuple[Any, list[CodeRead]]] = {}
    cells = []
    for read in reads:
        if read.key is None:
            cells.append(read)
        else:  # a namespace per group; reads through a class, one group per object (ThroughClass)
            by_namespace.setdefault(namespace_id(read.namespace), (read.namespace, []))[1].append(read)
    tests = []
    for k, (namespace, group) in enumerate(by_namespace.values()):
        if isinstance(namespace, ThroughClass):
            scope[f"_g{k}"], scope[f"_f{k}"] = namespace.obj, operator.attrgetter(*(r.key for r in group))
        else:
            scope[f"_g{k}"], scope[f"_f{k}"] = namespace, operator.itemgetter(*(r.key for r in group))
        scope[f"_e{k}"] = tuple(r.expected for r in group) if len(group) > 1 else group[0].expected
        tests.append(f"_f{k}(_g{k}) == _e{k}")
    if cells:
        for k, read in enumerate(cells):
            scope[f"_c{k}"] = read.namespace
        scope["_cells"] = tuple(read.expected for read in cells)
        tests.append(f"({''.join(f'_c{k}.cell_contents, ' for k in range(len(cells)))}) == _cells")
    return tests


class _TracedDefinition:
    """The expected value of a function the code reads that had been replaced when the program was
    copied or loaded (the traced function's identity did not survive the copy): equal to a function
    of the traced :func:`definition` (the last one found equal is then known by identity)."""

    __slots__ = ("label", "definition", "found")

    def __init__(self, label: str, traced: Any) -> None:
        self.label, self.definition, self.found = label, traced, None

    def __eq__(self, other: object) -> bool:
        if other is not self.found:
            if definition(other) != self.definition:
                return False
            self.found = other
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"the function traced as {self.label}"


class _AsLoaded:
    """A saved guard's value taken again when the program is loaded: a class attribute's (a method,
    a property: the class's own), a tensor's whose value the trace read (a copy's own tensor)."""


def _guards_from(
    model: torch.nn.Module, reads: Reads, copies: dict[str, str], constants: set[int], filled: set[str], counters: frozenset[str]
) -> list[StateGuard]:
    """A guard per attribute the trace read (or would have read, in a copied layer), with the value
    it has on the real model after the capture; a list, dict or set under a name in ``filled`` (the
    code fills it in place: a log, a cache) by identity; none for what the traced code set on a
    module only by updating it (a name in ``counters`` that no method of the module's class,
    torch's included, reads otherwise: ``self.calls += 1``), or every call would be another situation."""
    modules = dict(named_modules(model))
    sources = [(path, reads.of_module(m)) for path, m in modules.items() if reads.of_module(m)]
    for copy, template in copies.items():
        sources += [
            (moved(path, template, copy), names)
            for path, names in list(sources)
            if inside(path, template) and moved(path, template, copy) in modules
        ]
    guards: dict[tuple, StateGuard] = {}
    for path, names in sources:
        module = modules[path]
        for name in sorted(names):
            if name in _MODULE_INTERNALS or _registered(module, name):
                continue  # structure and hooks (the structure check)
            if name in counters and name in reads.written_on(module) and name not in attributes_read_beyond_updates(type(module), True):
                continue  # its own bookkeeping
            _attribute_guards(guards, module, name, f"{path or '<root>'}.{name}", path, None, reads, constants, filled, HELD_DEPTH)
    for path, module in modules.items():  # the attributes the trace read on hooks that are objects (a flag)
        for where, hook in hook_objects(module):
            # not what it sets itself only to keep count (a counter, the last output); what it also reads otherwise, yes
            read = reads.of_held(hook) - (reads.written_on(hook) - attributes_read_beyond_updates(type(hook), False))
            for name in sorted(read):
                label = f"{path or '<root>'}.{where}.{name}"  # a list or dict it reads: a log it fills, by identity
                _attribute_guards(guards, hook, name, label, path, where, reads, constants, filled | read, HELD_DEPTH - 1)
    return list(guards.values())


def _held_reads(model: torch.nn.Module, reads: Reads) -> dict[str, set[str]]:
    """The attribute names the trace read on the plain objects the modules hold (``HELD_DEPTH``
    deep), keyed ``"module path|held.path"`` (``situation_code.py`` walks their methods' code)."""
    found: dict[str, set[str]] = {}

    def visit(obj: Any, names: set[str], key: str, depth: int) -> None:
        for name in sorted(names):
            value = vars(obj).get(name)
            inner = reads.of_held(value) if attribute(value, "__dict__") is not None else None
            if inner and depth > 0 and not isinstance(value, (torch.nn.Module, type)):
                held = f"{key}.{name}" if "|" in key else f"{key}|{name}"
                found[held] = set(inner)
                visit(value, inner, held, depth - 1)

    for path, module in named_modules(model):
        visit(module, reads.of_module(module), path, HELD_DEPTH)
    return found
_FILLED = (list, dict, set)  # containers the code fills in place: compared by identity (``code_reads``)


def _attribute_guards(
    guards: dict[tuple, StateGuard], obj: Any, name: str, label: str, path: str, held: str | None, reads: Reads,
    constants: set[int], filled: set[str], depth: int,
) -> None:
    """Add the guards on attribute ``name`` of ``obj`` (the module at ``path``, or the object held
    there along the dotted attribute path ``held``), and on the attributes the trace read of the
    object it holds, ``depth`` objects deep. An attribute a module lacked and the traced code then
    set on it is the model's lazily initialised state (transformers' ``_output_capturing_hooks_installed``,
    set by the first forward): its absence is not guarded, or the first real call would make the
    second another situation."""
    state = vars(obj)
    if name not in state:
        lazy = held is None and name in reads.written_on(obj)  # set by the model's own code on first use
        for guard in _not_on_instance(obj, label, path, held, name):
            if not (lazy and guard.where == "absent"):
                guards.setdefault(_guard_key(guard, obj), guard)
        return
    value = state[name]
    if attribute(value, "fxflops_own", False):
        return  # fxflops' own (a routing probe)
    if name in filled and isinstance(value, _FILLED) and not any(id(t) in constants for t in _leaves(value)):
        guard = StateGuard(label, path, held, name, value, "is")  # a log (its tensors, if any, unused by the trace)
    else:
        guard = _guard(label, path, held, name, value, constants, reads.values)
    guards.setdefault(("instance", id(state), name), guard)
    inner = attribute(value, "__dict__")
    if inner is None or plain(value) or guard.test != "is" or depth <= 0:
        return  # compared whole (by value or contents), or not an object the trace looked into
    inside = name if held is None else f"{held}.{name}"
    for name_inside in sorted(reads.of_held(value)):
        _attribute_guards(guards, value, name_inside, f"{label}.{name_inside}", path, inside, reads, constants, filled, depth - 1)


def _guard_key(guard: StateGuard, obj: Any) -> tuple:
    """Guards on one attribute of one object are made once (a class's attribute once per class)."""
    return (guard.where, id(type(obj)) if guard.where == "class" else id(vars(obj)), guard.key)


def _registered(module: torch.nn.Module, name: str) -> bool:
    """A name of the module's parameters, buffers or submodules (the structure check's)."""
    return name in module._parameters or name in module._buffers or name in module._modules


_MISSING = type("_Missing", (), {"__repr__": lambda self: "missing"})()
_ROUTED = frozenset({"forward"})  # set on instances by fxflops' own routes too: the structure check's (``fxflops_own``)


def _not_on_instance(obj: Any, label: str, path: str, held: str | None, name: str) -> list[StateGuard]:
    """The guards on an attribute read on ``obj`` that its ``__dict__`` lacks: that it stays absent
    there, and the value of the class that has it (not for ``nn.Module``'s and ``object``'s own
    machinery, nor what the structure check covers: ``forward`` set on the instance)."""
    owner = next((cls for cls in type(obj).__mro__ if name in vars(cls)), None)
    if owner in TORCH_BASES:
        return []
    guards = [] if name in _ROUTED else [StateGuard(f"{label} (on the instance)", path, held, name, None, "is", "absent")]
    if owner is not None:
        value = vars(owner)[name]
        guards.append(StateGuard(f"{owner.__qualname__}.{name} (class attribute)", path, held, name, copied(value), _test_for(value), "class"))
        if _computing_descriptor(value):  # ``reps = Setting()``: what its __get__ gives, read so per call
            try:
                got = getattr(obj, name)
            except Exception:  # noqa: BLE001 - its own error: the class guard stands alone
                return guards
            guards.append(StateGuard(f"{label} (as {type(value).__name__} computes it)", path, held, name, copied(got), _test_for(got), "computed"))
    elif _resolves_names_itself(type(obj)):  # an alias (a transformers config's attribute_map), a dict behind __getattr__
        try:
            value = getattr(obj, name)
        except Exception:  # noqa: BLE001 - absent: the "absent" guard says so
            return guards
        guards.append(StateGuard(f"{label} (as {type(obj).__name__} resolves it)", path, held, name, copied(value), _test_for(value), "computed"))
    return guards


def _computing_descriptor(value: Any) -> bool:
    """A class attribute of model code's own descriptor type (a ``__get__`` computing the value read
    on the instance): not a function, property or the like, whose code the walk follows."""
    kind = type(value)
    return hasattr(kind, "__get__") and not library_module(kind.__module__ or "") and not isinstance(value, METHODS)


def _test_for(value: Any) -> str:
    """How a value read off the instance is compared: plain values by ``==`` (flags and None, and
    objects, by identity)."""
    return "==" if plain(value) and not isinstance(value, (bool, type(None))) else "is"


def _resolves_names_itself(cls: type) -> bool:
    """Whether ``cls`` (or a base of it other than ``object`` and ``nn.Module``) defines
    ``__getattribute__`` or ``__getattr__``: a name neither its instances nor its classes hold can
    still have a value, read through that code (compared per call by reading it the same way)."""
    return any("__getattribute__" in vars(c) or "__getattr__" in vars(c) for c in cls.__mro__ if c not in TORCH_BASES)


def _guard(label: str, path: str, held: str | None, key: str, value: Any, constants: set[int], values: set[int]) -> StateGuard:
    if isinstance(value, torch.Tensor) and id(value) in values:  # its value is in the program: this tensor, unmodified
        return StateGuard(label, path, held, key, (value, value._version), "value")
    if isinstance(value, (bool, type(None))):
        return StateGuard(label, path, held, key, value, "is")
    if plain(value):
        return StateGuard(label, path, held, key, copied(value), "==")
    if _modules_and_plain(value):  # transformers' per-layer ``_kernel_funcs``: compared item by item, modules by identity
        items = {k: copied(v) for k, v in value.items()} if type(value) is dict else type(value)(copied(v) for v in value)
        return StateGuard(label, path, held, key, items, "==")
    if isinstance(value, (torch.Tensor, list, tuple, dict, set, frozenset)):
        used = any(isinstance(t, torch.Tensor) and id(t) in constants for t in _leaves(value))
        return StateGuard(label, path, held, key, value_key(value, used), "shapes" if used else "key")
    if isinstance(value, functools.partial) and plain(value.args) and plain(value.keywords):
        return StateGuard(label, path, held, key, SamePartial(value), "==")  # an activation's settings
    if _by_contents(value):
        try:
            return StateGuard(label, path, held, key, value_key(value, True), "shapes")
        except InputError:  # too large to compare per call (a big array): by identity
            pass
    return StateGuard(label, path, held, key, value, "is")


def _modules_and_plain(value: Any) -> bool:
    """A small list, tuple or dict of modules and plain values (their own state is the structure
    check's): ``==`` on a copy compares it exactly, without keying each item."""
    if type(value) not in (list, tuple, dict) or len(value) > 64:
        return False
    items = value.values() if isinstance(value, dict) else value
    keys_plain = not isinstance(value, dict) or all(plain(k, 0) for k in value)
    return keys_plain and all(isinstance(v, torch.nn.Module) or plain(v) for v in items)


def _by_contents(value: Any) -> bool:
    """Values whose contents can change under the same identity and whose reads cannot be recorded
    one by one: a ``functools.partial`` (its ``keywords`` dict), a numpy array, an object with
    ``__slots__`` or of a class defined in C (``types.SimpleNamespace``: its attribute reads go
    unrecorded): guarded by their whole contents (``call_keys.value_key``)."""
    if isinstance(value, (torch.nn.Module, type)) or (callable(value) and not isinstance(value, functools.partial)):
        return False
    kind = type(value)
    static_type = not kind.__flags__ & _HEAP_TYPE
    return isinstance(value, functools.partial) or kind.__module__ == "numpy" or (
        attribute(value, "__dict__") is None and attribute(value, "__slots__") is not None
    ) or (static_type and attribute(value, "__dict__") is not None)


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python (its reads can be recorded)


def _leaves(value: Any) -> list:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _chunks(items: list[str], size: int) -> list[list[str]]:
    return [items[i : i + size] for i in range(0, len(items), size)] or [["True"]]
