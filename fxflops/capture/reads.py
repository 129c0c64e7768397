"""What a capture read from the model besides its inputs: the state its program depends on.

A traced program is exact for the state the model was in: the ``training`` flags its code branched on,
flags such as ``gradient_checkpointing``, numbers such as a norm's ``eps``, the settings of a config
object (``config._attn_implementation``). torch.compile guards on the attributes its trace read;
fxflops does the same. While capturing (and only in the capturing thread, ``capture/scope.py``),
every attribute read on the model's modules, and on the plain Python objects they hold (configs,
dataclasses; three levels deep), is recorded by name (and every attribute the traced code assigns on
a module: lazily initialised state, such as a flag saying hooks are installed) (on the twin the trace runs on, under the user's
object it copies). :func:`recording_reads` fills a
:class:`Reads`; ``fxflops/situation.py`` turns them into guards on the *real* state after the capture.

Reads inside a layer billed as a copy of a traced one (``capture/reuse.py``, a lifted module's cached
trace) are not made; the guards of the traced layer are applied to the copy by relative path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import _AttrProxy

from fxflops.capture.scope import patched

NOT_HELD = (torch.nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)


@dataclass
class Reads:
    """Attribute names read during a capture: ``modules[id(module.__dict__)]`` and
    ``held[id(object)]`` (objects the modules hold, e.g. a config), each a set of names."""

    modules: dict[int, set[str]] = field(default_factory=dict)
    held: dict[int, set[str]] = field(default_factory=dict)
    values: set[int] = field(default_factory=set)  # ids of real tensors whose values the trace read (``int(self.reps)``)
    written: dict[int, set[str]] = field(default_factory=dict)  # attributes the traced code assigned, by module ``__dict__``
    functions: list[Any] = field(default_factory=list)  # the call's function arguments: the code the trace ran (their globals)
    # lru caches whose function the trace ran on a miss, doing floating-point work: id -> (cache, whether the user's was empty)
    memos: dict[int, tuple[Any, bool]] = field(default_factory=dict)

    def of_module(self, module: torch.nn.Module) -> set[str]:
        return self.modules.get(id(vars(module)), set())

    def of_held(self, obj: Any) -> set[str]:
        return self.held.get(id(obj), set())

    def written_on(self, module: torch.nn.Module) -> set[str]:
        return self.written.get(id(vars(module)), set())


def argument_functions(arguments: Any) -> list[Any]:
    """The functions among a call's arguments (and in their lists, tuples and dicts): plain
    functions, bound methods and ``functools.partial`` objects, whose code the trace runs and whose
    globals it may read (``fxflops/situation_code.py`` guards those as the model's own code's)."""
    found, todo = [], [(arguments, 0)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            found.append(value)
        elif depth <= _ARGUMENT_DEPTH and isinstance(value, (dict, list, tuple)):
            todo.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return found


_ARGUMENT_DEPTH = 3  # containers inside the call's arguments looked into for functions


def named_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's modules by path: its registered ones (``named_modules``, duplicates kept), then
    the modules its modules hold without registering them and theirs, transitively: one set in the
    ``__dict__`` (``self.__dict__["teacher"] = teacher``, a frozen distillation teacher kept out of
    ``parameters()``) or in a dict, list or tuple there (``self.helpers = {"t": t}``), at paths such as
    ``teacher.layers.0`` and ``helpers.t`` (:func:`module_at` resolves them). The code runs them as
    it runs the registered ones: their attributes, structure and hooks are the program's state too."""
    found = list(model.named_modules(remove_duplicate=False))
    seen = {id(m) for _, m in found}
    todo = list(found)
    while todo:
        path, module = todo.pop(0)
        for name, value in list(vars(module).items()):
            if name in _MODULE_SLOTS or (type(value) not in _CONTAINERS and not isinstance(value, torch.nn.Module)):
                continue  # the registered ones (found above), and the flags, numbers and hook dicts
            for where, held in _held_modules(value, f"{path}.{name}" if path else name, _HELD_MODULE_DEPTH):
                if id(held) not in seen:
                    inner = [(f"{where}.{p}" if p else where, m) for p, m in held.named_modules(remove_duplicate=False)]
                    seen.update(id(m) for _, m in inner)
                    found += inner
                    todo += inner
    return found


_MODULE_SLOTS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_HELD_MODULE_DEPTH = 2  # containers inside containers of a module's __dict__ looked into for modules
_CONTAINERS = (dict, list, tuple)


def _held_modules(value: Any, path: str, depth: int) -> Iterator[tuple[str, torch.nn.Module]]:
    if isinstance(value, torch.nn.Module):
        yield path, value
    elif depth > 0 and type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, (str, int)) and "." not in str(key):
                yield from _held_modules(item, f"{path}.{key}", depth - 1)


def module_at(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The module at a :func:`named_modules` path: each step a registered submodule, else an
    attribute of the module's ``__dict__``, an item of a dict (by key) or of a list or tuple (by
    index). Raises KeyError, AttributeError, IndexError or ValueError when it is gone."""
    found: Any = model
    for part in path.split(".") if path else ():
        if isinstance(found, torch.nn.Module):
            modules = found._modules
            found = modules[part] if part in modules else vars(found)[part]
        elif isinstance(found, dict):
            found = found[part] if part in found else found[int(part)]
        else:
            found = found[int(part)]
    if not isinstance(found, torch.nn.Module):
        raise AttributeError(f"{path} is no longer a module")
    return found


HELD_DEPTH = 6  # objects inside objects (a config's sub-configs, hydra- or yacs-style nesting) a capture copies and records


def held_objects(model: torch.nn.Module, depth: int = HELD_DEPTH) -> dict[int, Any]:
    """The plain Python objects (not modules, tensors, functions or builtins) held as attributes by
    the model's modules, and by those objects, ``depth`` levels deep: configs, their sub-configs
    (``config.text_config``) and what those hold, dataclasses; and the modules' hooks that are
    objects with state (:func:`hook_objects`)."""
    found: dict[int, Any] = {}
    frontier: list[Any] = [m for _, m in named_modules(model)]
    for module in list(frontier):
        for _, hook in hook_objects(module):
            if id(hook) not in found:
                found[id(hook)] = hook
                frontier.append(hook)
    for _ in range(depth):
        nxt = []
        for holder in frontier:
            for value in getattr(holder, "__dict__", {}).values():
                if _is_held(value) and id(value) not in found:
                    found[id(value)] = value
                    nxt.append(value)
        frontier = nxt
    return found


HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hook_objects(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """The module's hooks that are objects with state of their own (a callable instance, the
    instance a bound method is bound to: an activation-steering hook with an ``on`` flag), as
    ``(where, object)``; ``where`` (``"_forward_hooks#0"``: the dict and the position in it) is found
    again by :func:`hook_at`. Their attributes the trace read are the program's state too."""
    found = []
    for name in HOOK_DICTS:
        for i, hook in enumerate(vars(module).get(name, {}).values()):
            owner = hook.__self__ if isinstance(hook, types.MethodType) else hook
            if _is_held(owner):
                found.append((f"{name}#{i}", owner))
    return found


def hook_at(module: torch.nn.Module, where: str) -> Any:
    """The hook object at a :func:`hook_objects` place (KeyError, IndexError when it is gone)."""
    name, position = where.split("#")
    hook = list(vars(module)[name].values())[int(position)]
    return hook.__self__ if isinstance(hook, types.MethodType) else hook


def _is_held(value: Any) -> bool:
    kind = type(value)
    return (
        not issubclass(kind, NOT_HELD)
        and not reads_run_code(kind)
        and attribute(value, "__dict__") is not None
        and kind.__module__ not in ("builtins", "functools", "collections", "enum")
        and not issubclass(kind, BaseException)
    )


def reads_run_code(kind: type) -> bool:
    """Whether reading an attribute of an instance of ``kind``, a class of torch's or of the
    standard library, runs Python code of its class (a ``__getattribute__`` of its own: torch's
    deprecated ``torch.distributed.reduce_op`` warns on every read, an error under ``-W error``):
    such an object is not walked, only kept by identity. Model code's classes are read as they
    are (a transformers config resolves its ``attribute_map`` aliases so: those reads are state)."""
    lookup = getattr(kind, "__getattribute__", None)
    return isinstance(lookup, types.FunctionType) and library_module(getattr(kind, "__module__", None) or "")


def _tracers_own(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` is make_fx's module-stack tracer reading its own proxy of a module (an
    ``_AttrProxy``, which shares the module's ``__dict__``): ``get_base``, ``reset_proxy_mapping``
    are the tracer's methods, not state of the model's (recorded, every module would carry two
    guards of absent names, checked on every call)."""
    return isinstance(obj, _AttrProxy) and any(name in vars(cls) for cls in type(obj).__mro__ if issubclass(cls, _AttrProxy))


@contextlib.contextmanager
def recording_reads(model: torch.nn.Module, reads: Reads, originals: dict[int, Any]) -> Iterator[None]:
    """Record attribute reads on ``model``'s modules and held objects for the block (a capture) into
    ``reads``, under the objects they copy: ``model`` is a twin (``capture/isolation.py``) and
    ``originals`` maps its objects' ids to the user's."""

    def own(obj: Any) -> Any:
        return originals.get(id(obj), obj)

    every = [m for _, m in named_modules(model)]
    modules = {id(vars(m)): reads.modules.setdefault(id(vars(own(m))), set()) for m in every}
    held = held_objects(model)
    held_names = {key: reads.held.setdefault(id(own(obj)), set()) for key, obj in held.items()}
    classes = {type(obj) for obj in held.values()}
    with contextlib.ExitStack() as stack:
        original = stack.enter_context(patched(torch.nn.Module, "__getattribute__", lambda self, name: record(self, name)))

        def record(self: Any, name: str) -> Any:
            if name[:2] != "__" and not _tracers_own(self, name):
                names = modules.get(id(object.__getattribute__(self, "__dict__")))
                if names is not None:
                    names.add(name)
            return original(self, name)

        assigning = stack.enter_context(patched(torch.nn.Module, "__setattr__", lambda self, name, value: assign(self, name, value)))
        written = {id(vars(m)): reads.written.setdefault(id(vars(own(m))), set()) for m in every}

        def assign(self: Any, name: str, value: Any) -> None:
            names = written.get(id(object.__getattribute__(self, "__dict__")))
            if names is not None:
                names.add(name)
            assigning(self, name, value)

        hooks = {id(hook) for m in every for _, hook in hook_objects(m)}
        hook_written = {key: reads.written.setdefault(id(vars(own(obj))), set()) for key, obj in held.items() if key in hooks}
        for cls in classes:
            try:
                stack.enter_context(_recording_class(cls, held_names))
                if any(type(held[key]) is cls for key in hook_written):  # what a hook object sets on itself (a counter)
                    stack.enter_context(_recording_assignments(cls, hook_written))
            except TypeError:  # an extension type, whose attributes cannot be set: its reads go unrecorded
                continue
        for name in _VALUE_READS:
            stack.enter_context(_recording_value_reads(name, reads.values, originals))
        yield


_VALUE_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__complex__")


def _recording_value_reads(name: str, values: set[int], originals: dict[int, Any]) -> contextlib.AbstractContextManager:
    """Record the real tensors whose values the trace reads with ``Tensor.<name>`` (a plain tensor
    attribute used as a loop count: its value is baked into the program like a constant)."""

    def wrap(original: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(self, FakeTensor):
                values.add(id(originals.get(id(self), self)))
            return original(self, *args, **kwargs)
        return read

    return _wrapping(torch.Tensor, name, wrap)


def _recording_assignments(cls: type, written: dict[int, set[str]]) -> contextlib.AbstractContextManager:
    """Record the attributes the traced code sets on the instances of ``cls`` in ``written``."""

    def wrap(original: Any) -> Any:
        def assign(self: Any, name: str, value: Any) -> None:
            names = written.get(id(self))
            if names is not None:
                names.add(name)
            original(self, name, value)
        return assign

    return _wrapping(cls, "__setattr__", wrap)


def _recording_class(cls: type, held_names: dict[int, set[str]]) -> contextlib.AbstractContextManager:
    """Record reads on the instances of ``cls`` that the model holds."""

    def wrap(original: Any) -> Any:
        def record(self: Any, name: str) -> Any:
            if name[:2] != "__":
                names = held_names.get(id(self))
                if names is not None:
                    names.add(name)
            return original(self, name)
        return record

    return _wrapping(cls, "__getattribute__", wrap)


@contextlib.contextmanager
def _wrapping(owner: Any, name: str, wrap: Any) -> Iterator[None]:
    """``owner.name`` is ``wrap(original)`` in capturing threads for the block (``scope.patched``)."""
    wrapped: list[Any] = []
    with patched(owner, name, lambda *args, **kwargs: wrapped[0](*args, **kwargs)) as original:
        wrapped.append(wrap(original))
        yield


def library_module(name: str) -> bool:
    """torch's, fxflops' and the standard library's modules: not model code (their functions are not
    walked for what they read, their classes' attributes are not a call's situation). A
    standard library name is taken for the standard library only where the module loaded under it
    is (built in, or a file of the interpreter's library): model code in a ``trace.py`` of its own
    is walked."""
    top = name.partition(".")[0]
    if top in ("torch", "fxflops"):
        return True
    if top not in sys.stdlib_module_names:
        return False
    path = getattr(sys.modules.get(top), "__file__", None)
    return path is None or os.path.realpath(path).startswith(_STANDARD_LIBRARY)


_STANDARD_LIBRARY = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep


def attribute(value: Any, name: str, default: Any = None) -> Any:
    """``getattr(value, name, default)`` that never raises: a user's object whose ``__getattr__``
    raises something else than AttributeError for a name it lacks (``class AttrDict(dict):
    __getattr__ = dict.__getitem__`` raises KeyError), or a property that fails, reads as absent."""
    if reads_run_code(type(value)):  # its own lookup is code: not run by fxflops
        return default
    try:
        return getattr(value, name, default)
    except Exception:  # noqa: BLE001 - any object's own lookup
        return default
