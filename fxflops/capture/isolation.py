"""A capture leaves the user's objects as they were, also while it runs.

The fake trace runs the model's own Python code, which may write to the objects it is given: a
key-value cache appends the step's keys and values (fake ones, in a trace), a model keeps a tensor it
computed (``self.rope_deltas = ...``), a layer counts its calls; and the capture itself puts fake
parameters into the modules (``functional_call``), stand-in ``forward`` methods on lifted and
repeated layers, and settings into configs. None of that may reach the user's objects: fake tensors
would reach the next real forward, counters would count twice, and another thread running the same
model meanwhile (an evaluation thread) would compute with fake weights.

- :func:`twin_of` gives each trace its own copy of the model's module tree (with the modules it holds
  unregistered, ``capture/reads.py``'s :func:`named_modules`): every module a new object
  of its class whose attributes are the original's, its containers (``_parameters``, ``_buffers``,
  ``_modules``, hook dicts, lists) copied one level and pointing to the twins of the tree's modules,
  sharing every tensor; the plain objects the modules hold (configs, two levels deep,
  ``capture/reads.py``) are copied the same way. The trace writes only to the twin.
- :func:`isolated_call` gives the trace its own copy of every argument that is not a tensor, a plain
  value or a container of those (a cache object, a config passed in, also one whose class keeps its
  state in ``__slots__``): a deep copy that shares the tensors, modules and functions inside it. An
  object that cannot be copied is passed as it is and its attributes are restored afterwards, as for
  modules. An iterator argument (a generator, ``iter(steps)``) refuses the capture, naming it, at the
  root module: a trace would consume it (the real call would get what is left), and one traced on a
  copy would keep its length for every call; the root's own code, which reads it, is measured on the
  real call instead (``fxflops/islands.py``), its children traced.
- :func:`preserving_state` restores, after the block, the attributes of every module of the model and
  of the plain objects they hold (their ``__dict__`` and their slots), and the contents of their list,
  dict, set and deque attributes (nested ones too), by identity: for what the twin does not own (an
  original module reached through a closure, such as a compiled submodule's ``forward``; an argument
  that could not be copied). The same snapshots (:func:`saved_object`, :func:`saved_contents`, ...)
  serve ``capture/side_effects.py``, which puts back what the model's code writes outside its modules.
- :func:`user_tensors_read_only`: a tensor the trace did not make (a plain tensor attribute such as a
  step counter, a tensor in a list attribute or a global) is real, and fake tensor mode runs an op
  whose tensors are all real *for real* (constant propagation), so ``self.steps.add_(1)`` would
  count the user's steps once more per capture. While tracing, an op that writes to a real tensor
  writes to the fake that stands for it instead (the one fake tensor mode converts it to on every
  read, so the trace still sees its own writes).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import types
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fxflops.capture.reads import attribute, held_objects, named_modules
from fxflops.errors import CaptureError

_MISSING = object()
_CONTAINERS = (list, dict, set)
_PLAIN_CONTAINERS = frozenset({list, dict, set, collections.OrderedDict})  # whose .copy() keeps their type
_RESTORED = (list, dict, set, collections.deque)  # containers whose contents a snapshot puts back
MAX_NESTING = 3  # containers inside containers whose contents a snapshot puts back

Restorer = Callable[[], None]


def _items(value: Any, attempts: int = 8) -> list:
    """The items of a container, copied; again when it changed while copied (a weak container the
    garbage collector empties, a registry another thread fills)."""
    for attempt in range(attempts):
        try:
            return list(value.items()) if isinstance(value, dict) else list(value)
        except RuntimeError:  # "changed size during iteration"
            if attempt == attempts - 1:
                raise
    return []


def _unchanged(now: list, before: list) -> bool:
    """Same items by identity (dict items: equal keys, identical values)."""
    if len(now) != len(before):
        return False
    for a, b in zip(now, before):
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2:
            if a[0] != b[0] or a[1] is not b[1]:
                return False
        elif a is not b:
            return False
    return True


def saved_contents(container: Any, depth: int = MAX_NESTING) -> list[Restorer]:
    """Restorers putting back the items of ``container`` (a list, dict, set or deque) by identity,
    and those of the containers inside it, ``depth`` levels deep (a dict of lists of records)."""
    items = _items(container)

    def restore() -> None:
        if not _unchanged(_items(container), items):
            container.clear()
            if isinstance(container, (dict, set)):
                container.update(items)
            else:
                container.extend(items)

    inner = [v for item in items for v in ((item[1],) if isinstance(container, dict) else (item,)) if isinstance(v, _RESTORED)]
    return [restore, *(r for value in inner if depth > 0 for r in saved_contents(value, depth - 1))]


def saved_bindings(state: dict, names: Collection[str] | None = None) -> Restorer:
    """A restorer putting back the entries of ``state`` (an object's ``__dict__``, a module's
    globals) by identity: those named in ``names``, or all of them (then also removing new ones)."""
    if names is None:
        before = dict(state)
    else:
        before = {name: state.get(name, _MISSING) for name in names}

    def restore() -> None:
        if names is None:
            for key in [k for k in state if k not in before]:
                del state[key]
        for key, value in before.items():
            if value is _MISSING:
                state.pop(key, None)
            elif state.get(key, _MISSING) is not value:
                state[key] = value

    return restore


@functools.cache
def slot_descriptors(cls: type) -> tuple[Any, ...]:
    """The descriptors of the slots instances of ``cls`` have (of every class of its MRO)."""
    return tuple(
        descriptor
        for klass in cls.__mro__
        if "__slots__" in vars(klass)
        for descriptor in vars(klass).values()
        if isinstance(descriptor, types.MemberDescriptorType)
    )


def _slot_values(obj: Any) -> dict[Any, Any]:
    values = {}
    for descriptor in slot_descriptors(type(obj)):
        try:
            values[descriptor] = descriptor.__get__(obj, type(obj))
        except AttributeError:  # an unset slot
            values[descriptor] = _MISSING
    return values


def attribute_values(obj: Any) -> list[Any]:
    """The values of ``obj``'s attributes: its ``__dict__``'s and its slots'."""
    own = attribute(obj, "__dict__")
    values = list(own.values()) if isinstance(own, dict) else []
    if slot_descriptors(type(obj)):
        values += [v for v in _slot_values(obj).values() if v is not _MISSING]
    return values


def saved_object(obj: Any) -> list[Restorer]:
    """Restorers putting back ``obj``'s attributes (``__dict__`` entries and slot values) by
    identity and the contents of the containers they hold."""
    own = attribute(obj, "__dict__")
    state = own if isinstance(own, dict) else {}
    slots = _slot_values(obj) if slot_descriptors(type(obj)) else {}

    def restore_slots() -> None:
        for descriptor, value in slots.items():
            try:
                now = descriptor.__get__(obj, type(obj))
            except AttributeError:
                now = _MISSING
            if now is value:
                continue
            if value is _MISSING:
                descriptor.__delete__(obj)
            else:
                descriptor.__set__(obj, value)

    held = [value for value in (*state.values(), *slots.values()) if issubclass(type(value), _RESTORED)]
    restorers = [saved_bindings(state)] if state is own else []
    return restorers + ([restore_slots] if slots else []) + [r for value in held for r in saved_contents(value)]


def restore_all(restorers: list[Restorer]) -> None:
    for restore in restorers:
        restore()


@contextlib.contextmanager
def preserving_state(model: torch.nn.Module, extra: list[Any] = ()) -> Iterator[None]:
    """The model's modules and held objects (and ``extra`` objects) exactly as before, after the block."""
    objects = {id(m): m for _, m in named_modules(model)} | held_objects(model) | {id(o): o for o in extra}
    saved = [r for obj in objects.values() for r in saved_object(obj)]
    try:
        yield
    finally:
        restore_all(saved)


@dataclass(frozen=True)
class Twin:
    """A model's module tree copied for one trace (see the module docstring)."""

    model: torch.nn.Module
    originals: dict[int, Any]  # id(copy) -> the user's object it copies


def twin_of(model: torch.nn.Module) -> Twin:
    """A copy of ``model``'s modules and held objects for one trace to run on and write to."""
    objects = {id(m): m for _, m in named_modules(model)} | held_objects(model)
    copies = {key: twin for key, obj in objects.items() if (twin := _blank(obj)) is not None}
    for key, twin in copies.items():
        vars(twin).update({name: _owned(value, copies) for name, value in vars(objects[key]).items()})
    return Twin(copies.get(id(model), model), {id(twin): objects[key] for key, twin in copies.items()})


def _blank(obj: Any) -> Any:
    """A new object of ``obj``'s class with an empty ``__dict__`` (its ``__init__`` not run), or
    ``None`` when the class keeps state outside ``__dict__`` or cannot be made so (then shared)."""
    if slot_descriptors(type(obj)):
        return None
    try:
        return object.__new__(type(obj))
    except TypeError:
        return None


def _owned(value: Any, copies: dict[int, Any]) -> Any:
    """``value`` as the twin holds it: a copied object's copy, a method rebound to the copy, a
    container copied one level with copied objects in it; anything else shared. A wrapper fxflops
    installed on a module (``fxflops_wraps``: a generation route, a routing probe) is not the
    model's: the twin holds what it wraps."""
    while attribute(value, "fxflops_wraps") is not None:
        value = value.fxflops_wraps
    if id(value) in copies:
        return copies[id(value)]
    kind = type(value)  # by its type: ``isinstance`` would read ``__class__`` through an object's own lookup
    if kind is types.MethodType and id(value.__self__) in copies:
        return types.MethodType(value.__func__, copies[id(value.__self__)])
    if issubclass(kind, (functools.partial, types.FunctionType)):
        return _rebound(value, copies)
    if kind is tuple:
        return tuple(copies.get(id(item), item) for item in value)
    if not issubclass(kind, _CONTAINERS):
        return value
    try:
        own = value.copy() if type(value) in _PLAIN_CONTAINERS else copy.copy(value)
    except Exception:  # noqa: BLE001 - a container that cannot be copied: shared, restored by preserving_state
        return value
    if isinstance(own, dict):
        own.update({key: copies[id(item)] for key, item in value.items() if id(item) in copies})
    elif isinstance(own, list):
        own[:] = [copies.get(id(item), item) for item in value]
    return own


def _rebound(function: Any, copies: dict[int, Any]) -> Any:
    """A ``functools.partial`` or a function a module holds, made again over the copies of the objects
    it holds (in its closure cells or default arguments) (accelerate's hooks set ``module.forward = partial(new_forward, module)``: kept as it is,
    the twin's forward would run the user's module, not the twin): the same function otherwise."""
    if isinstance(function, functools.partial):
        parts = [function.func, *function.args, *function.keywords.values()]
        if not any(id(p) in copies or isinstance(p, (types.MethodType, functools.partial)) for p in parts):
            return function
        keywords = {k: _owned(v, copies) for k, v in function.keywords.items()}
        made = functools.partial(_owned(function.func, copies), *(_owned(a, copies) for a in function.args), **keywords)
    else:
        cells = function.__closure__ or ()
        defaults, kwdefaults = function.__defaults__ or (), function.__kwdefaults__ or {}
        if not any(_cell_holds_copied(cell, copies) for cell in cells) and not any(
            id(v) in copies for v in (*defaults, *kwdefaults.values())
        ):
            return function
        closure = tuple(types.CellType(_owned(cell.cell_contents, copies)) if _cell_holds_copied(cell, copies) else cell for cell in cells)
        own_defaults = tuple(copies.get(id(v), v) for v in defaults) if function.__defaults__ is not None else None
        made = types.FunctionType(function.__code__, function.__globals__, function.__name__, own_defaults, closure)
        made.__kwdefaults__ = {k: copies.get(id(v), v) for k, v in kwdefaults.items()} if function.__kwdefaults__ is not None else None
    vars(made).update({k: _owned(v, copies) for k, v in vars(function).items()})  # functools.wraps' attributes
    return made


def _cell_holds_copied(cell: Any, copies: dict[int, Any]) -> bool:
    """Whether a closure cell holds a copied object, or a method bound to one (a compiled submodule's
    ``forward`` wraps its original module's ``__call__``)."""
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return id(value) in copies or type(value) is types.MethodType and id(value.__self__) in copies


_PLAIN = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size, type)


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN)


def _has_state(value: Any) -> bool:
    """Whether ``value`` is an object with attributes of its own (a ``__dict__`` or slots)."""
    return attribute(value, "__dict__") is not None or bool(slot_descriptors(type(value)))


def _shared(obj: Any) -> dict[int, Any]:
    """A deepcopy memo keeping the tensors, modules and functions reachable from ``obj`` shared."""
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [obj]
    while stack and len(seen) < 10_000:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (torch.Tensor, torch.nn.Module)) or callable(value) and attribute(value, "__dict__") is None:
            memo[id(value)] = value
            continue
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif _has_state(value):
            stack.extend(attribute_values(value))
    return memo


def _label(path: tuple, names: list[str]) -> str:
    """An argument's name from its pytree path in ``(args, kwargs)``: the parameter's name (from
    ``names``, the positional arguments' names) and the steps below it."""
    (where, key), rest = path[:2], path[2:]
    index = getattr(key, "idx", None)
    name = str(key.key) if where.idx == 1 else names[index] if index < len(names) else f"argument {index}"
    return name + pytree.keystr(rest)


def isolated_call(args: tuple, kwargs: dict, names: list[str] = ()) -> tuple[tuple, dict, list[Any]]:
    """``(args, kwargs)`` with every opaque argument replaced by a copy sharing its tensors; also the
    objects that could not be copied (to be restored with :func:`preserving_state`). An iterator
    argument raises :class:`CaptureError` naming it (``names``: the positional arguments' names)."""
    uncopied: list[Any] = []

    def own(path: tuple, value: Any) -> Any:
        if isinstance(value, Iterator):
            raise CaptureError(
                f"argument {_label(path, list(names))!r} is an iterator ({type(value).__name__}): a trace would consume "
                "it, or keep the length of a copy for every call; the code that reads it is measured on each call instead",
                module="",
            )
        if _plain(value) or not _has_state(value) or isinstance(value, torch.nn.Module) or callable(value):
            return value
        try:
            return copy.deepcopy(value, _shared(value))
        except Exception:  # noqa: BLE001 - an object deepcopy cannot handle: restored afterwards instead
            uncopied.append(value)
            return value

    args, kwargs = pytree.tree_map_with_path(own, (args, kwargs))
    return args, kwargs, uncopied


@functools.cache
def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an ATen op writes to (``Tensor(a!)`` in its schema)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple(
        (i, argument.name) for i, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _faked(mode: FakeTensorMode, value: Any) -> Any:
    """``value`` with its real tensors replaced by the fakes ``mode`` stands them for."""
    if isinstance(value, (list, tuple)):
        return type(value)(_faked(mode, v) for v in value)
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        return mode.fake_tensor_converter.from_real_tensor(mode, value)
    return value


@contextlib.contextmanager
def user_tensors_read_only(mode: FakeTensorMode) -> Iterator[None]:
    """For the block, ``mode`` never runs an op that writes to a real tensor: the op writes to the
    tensor's fake instead (see the module docstring)."""
    dispatch = mode.dispatch

    def guarded(func: Any, classes: Any, args: Any = (), kwargs: Any = None) -> Any:
        written = _written(func)
        if written:
            args, kwargs = list(args), dict(kwargs or {})
            for i, name in written:
                if i < len(args):
                    args[i] = _faked(mode, args[i])
                elif name in kwargs:
                    kwargs[name] = _faked(mode, kwargs[name])
        return dispatch(func, classes, args, kwargs)

    own = vars(mode).get("dispatch", _MISSING)
    mode.dispatch = guarded
    try:
        yield
    finally:
        if own is _MISSING:
            del mode.dispatch
        else:
            mode.dispatch = own
