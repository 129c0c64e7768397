"""The part of a call's situation that lives in the model's Python code: globals and closures.

A trace runs the model's Python once, and what that Python read from outside the model is baked
into the program like a constant: a module-level flag (``REPEATS = 3``, ``USE_FUSED = True``), a
helper function a library patches in (``modeling_llama.apply_rotary_pos_emb = fused``), a value a
closure holds. torch.compile guards each such read (Dynamo sees every ``LOAD_GLOBAL``); fxflops runs
the code instead of interpreting it, so it guards what the code *can* read (:func:`code_reads`): the
names the model classes' functions load (their code objects' ``co_names``, nested code included)
that their module's globals hold, and the cells of their closures, following the functions those
name into their own globals (model code only: not torch's, not fxflops'); the same for the methods
the trace called on the plain objects the modules hold (``self.bank.read()``), the modules' hooks
(a hook object's ``__call__``, with ``self`` standing for the object), the functions the modules hold as attributes (``self.select = select``) and those the call passes (``how=fn``:
its key is its code and closure, its globals are read here; a saved program keeps those of importable
functions only). Plain values (numbers,
strings, flags, tuples of them) are compared by value, functions, bound methods and builtins by
identity, a ``functools.partial`` of plain arguments by its function and arguments. A module-level list,
dict or set of plain values is compared by value too (a setting changed in place, ``CONFIG["layers"]
= 2``, is another situation). How the code uses a container decides the rest (:func:`_uses`, from
the bytecode): one it only fills in place (``LOG.append(...)``, ``SEEN.add(...)``, ``STATS[k] =
v``) is a log or a registry, compared by identity, or every new entry would be another situation;
one it fills and also reads (``if key not in CACHE: CACHE[key] = w @ w.T``) is a memo, compared by
its entries (:class:`Entries`): whether an entry is there decides whether its work runs, so the
first call (which computes) and the later ones (which find it) are two situations; any other
container holding more than plain values, or more than :data:`MAX_COMPARED` of them, by its number
of entries (code that fills it through an alias or a library helper is still seen). A mapping
object that is not a dict (a registry such as transformers' ``ALL_ATTENTION_FUNCTIONS``) is
compared by the dicts of functions and plain values it keeps (:class:`RegistryContents`). Names
the code itself assigns (``global calls; calls += 1``, ``nonlocal``) are compared by type only
(:class:`OfType`; ``None`` and flags by value): a counter is its bookkeeping, not a situation (as a
recompile per call would be under Dynamo), while a lazily made value (``if _TABLE is None: _TABLE =
...``) is another situation once made. The same bytecode tells which attributes the code only
fills in place and never reads otherwise (a log, ``self.records.append(...)``): ``situation.py``
compares those by identity. Attributes the code reads on a module, a class or a plain object it
names as a global, a closure variable or a parameter's default (``settings.EXTRA``,
``pkg.layers.attention(...)``, ``os.environ.get("X")`` and ``os.getenv("X")``, ``Flags.FUSED``, ``ARGS.deep.n``,
``BLOCKS["vit"].extra``, ``FLAGS[0].on``; through a local assigned once, ``args = get_args(); args.flag``, where
``get_args`` returns a global, ``lru_cache``d or not) are reads of the namespace holding each value on the way (the objects and
modules passed by identity), and so are the attributes it reads on an object's class
(``type(self).WIDE``, ``self.__class__.WIDE``) that the model's module classes define: Dynamo
guards these as it guards a global, and no attribute access on the modules records them. An
attribute the code assigns on a module (``settings.calls += 1``) is compared by type, as an
assigned global is. Not followed: torch's and fxflops' modules, enumerations, and the standard
library but for ``os`` (``os.environ``; its functions are not walked) and plain namespaces
(``types.SimpleNamespace``, ``argparse.Namespace``). A tensor the code reads from outside the model
(``x @ TABLE``) is compared by identity and shape (:class:`SameTensor`). A torch setting the code
reads by calling a getter without arguments (``torch.get_num_threads()``,
``dist.is_initialized()``) or as a flag of ``torch.backends`` (``torch.backends.cudnn.deterministic``)
is compared by the value it has now (:func:`_getter_reads`); a torch function it calls through a
module (``F.linear``, ``torch.matmul``) by identity on that module (:func:`_torch_functions`: one
patched there runs other work). What the code reads
through ``super()`` (``super().forward(x)``) is compared by identity on the base class that defines
it, torch's classes too (:func:`_super_reads`). A method, property or class method the code
calls on such an object (``SETTINGS.enabled()``, ``SETTINGS.depth``) is compared by identity on
its class, and its code is walked with ``self`` standing for the object: what it reads there
(``self.on``, ``self.nested.wide``, another method) is read as the code's own attribute reads
are; a class attribute read through the object (``SETTINGS.REPEATS``) is compared as a global
is; one the object later gets of its own, shadowing its class's, too, and so are a slot's value
and what its ``__getattr__`` resolves (:class:`ThroughClass`; a ``cached_property`` is walked as a
property is). A
module's class method is walked with ``cls`` standing for its class, a bound method a module
holds with ``self`` standing for its object. The object a context variable holds (``CFG.get().deep``) is read as the capture saw it
(:class:`InContext`: a capture's context holds only the caller's flags, so another object set by
the caller is another situation, which ``instrument.py`` measures), and the object a thread-local
holds (``LOCAL.cfg.deep``) as the calling thread holds it (:class:`ThreadAttributes`). Not seen: an
object reached through a call's result other than a getter's, or through a computed key.
(Attributes of the model's modules and of the objects they hold, class attributes among them, are
``fxflops/situation.py``'s; the call's arguments ``fxflops/call_keys.py``'s.)
"""

from __future__ import annotations

import collections
import collections.abc
import contextvars
import dataclasses
import dis
import enum
import functools
import os
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.call_keys import SCALARS, value_key
from fxflops.capture.ambient import traced_context_value
from fxflops.capture.isolation import slot_descriptors
from fxflops.capture.reads import HOOK_DICTS, NOT_HELD, attribute, library_module, module_at, named_modules

MAX_FUNCTIONS = 512  # functions followed per model: the guards stay cheap, a huge code base is cut short
MAX_COMPARED = 1024  # values of a module-level container compared per call (a larger one: by identity)
_LIBRARIES = ("torch.", "fxflops.", "functools", "typing", "builtins", "collections", "abc", "contextlib")


@dataclass(frozen=True)
class CodeRead:
    """A value the model's code can read: ``namespace[key]`` (a module's globals, a closure cell's
    ``cell_contents`` as key ``None``) compared with ``expected`` by ``test`` (``"=="`` or ``"is"``)."""

    label: str
    namespace: Any
    key: str | None
    expected: Any
    test: str
    runs_on: tuple[Any, str] | None = dataclasses.field(default=None, compare=False, repr=False)
    """For a method read on an object's class (``SETTINGS.enabled``): the object its code runs on,
    with the path the code reaches it by; the walk reads that code's ``self.<name>`` there."""

    def now(self) -> Any:
        return self.namespace.cell_contents if self.key is None else self.namespace[self.key]

    def holds(self) -> bool:
        try:
            value = self.now()
        except (KeyError, IndexError, ValueError):  # deleted, an entry past the end, or an emptied cell
            return False
        return value == self.expected if self.test == "==" else value is self.expected


@dataclass(frozen=True)
class CodeReads:
    """What :func:`code_reads` finds: the reads to compare, the attribute names the code only fills
    in place (``filled``), and those it only updates (``counters``: ``self.calls += 1``, read
    nowhere but in their own update; empty when the walk was cut short)."""

    code: list[CodeRead]
    filled: set[str]
    counters: frozenset[str]
    reads_requires_grad: bool  # some walked code names ``requires_grad`` (``if self.fc.weight.requires_grad:``)


def code_reads(model: torch.nn.Module, called: dict[str, set[str]], functions: list[Any] = ()) -> CodeReads:
    """The globals and closure values the code the capture ran can read (module docstring): the
    methods the trace called on the model's modules (``called``: module path -> attribute names the
    capture read there, such as ``forward``, ``get_image_features``, a loss function property), the
    modules' hooks, and the functions their code names, transitively; and those of ``functions``, the
    call's function arguments (a ``how=`` callable the forward calls). With them, the attribute
    names that code only fills in place (``self.records.append(...)``, ``self.cache[key] = v``,
    ``module.losses.extend(...)`` in a hook) and uses in no other way: a log the model keeps, which
    ``situation.py`` compares by identity, or every call that adds to it would be another situation.
    One it also reads (``torch.cat(self.mems)``, ``len(self.records)``) stays compared by value: its
    contents can change the count (a memory the next call attends over). And the attribute names
    that code sets only by updating them (:func:`_loads_beyond_updates`): a module's call counter,
    compared by nothing (a new value per call would be a new situation per call). Containers of the
    globals and closures are compared as :func:`_container_read` says."""
    found: dict[tuple[int, str | None], CodeRead] = {}
    changed: set[tuple[int, str | None]] = set()  # containers some function changes in place
    used: set[tuple[int, str | None]] = set()  # containers some function reads, tests or passes on
    attributes_changed: set[str] = set()
    attributes_used: set[str] = set()
    attributes_set: set[str] = set()  # attributes some function assigns (``cfg.calls += 1``)
    module_attributes: set[tuple[int, str | None]] = set()  # reads along attribute chains (``cfg.FLAG``, ``ARGS.n``)
    class_attributes: set[str] = set()  # attributes read on a class (``type(module).FUSED``)
    beyond_updates: set[str] = set()  # attributes some function loads other than to update them
    walked, reads_requires_grad = 0, False
    for fn, reads in _followed(model, called, functions):
        walked += 1
        codes = list(_codes(fn.__code__))
        reads_requires_grad = reads_requires_grad or any("requires_grad" in c.co_names for c in codes)
        beyond_updates.update(*map(_loads_beyond_updates, codes))
        uses = _uses(fn.__code__)
        attributes_changed |= uses.attributes_changed
        attributes_used |= uses.attributes_used
        attributes_set |= _attributes_set(fn.__code__)
        for name, read in reads:
            where = (namespace_id(read.namespace), read.key)
            found.setdefault(where, read)
            if name.startswith("."):  # used as attributes are: ``cfg.CACHE[k] = v``, ``k in cfg.CACHE``
                module_attributes.add(where)
                name_changed, name_used = name[1:] in uses.attributes_changed, name[1:] in uses.attributes_used
            else:
                name_changed, name_used = name in uses.names_changed, name in uses.names_used
            if name_changed:
                changed.add(where)
            if name_used:
                used.add(where)
        class_attributes |= _class_attributes_read(fn.__code__)
    found.update(_class_reads(model, class_attributes, found))
    for name, read in _torch_module_functions(model):  # torch's own module classes run torch functions too
        found.setdefault((namespace_id(read.namespace), read.key), read)
    for where in module_attributes:  # one the code assigns (``cfg.calls += 1``) is its bookkeeping, as an assigned global
        if where[1] in attributes_set:
            read = found[where]
            found[where] = _assigned(read.label, read.namespace, read.key, read.now())
    code = [_container_read(read, where in changed, where in used) for where, read in found.items()]
    counters = frozenset(attributes_set - beyond_updates) if walked < MAX_FUNCTIONS else frozenset()
    return CodeReads(code, attributes_changed - attributes_used, counters, reads_requires_grad or walked >= MAX_FUNCTIONS)


def namespace_id(namespace: Any) -> int:
    """Who a read's namespace is: the object for reads through its class (one :class:`ThroughClass`
    is made per chain walked: their reads of one name are one read), else the namespace itself."""
    return id(namespace.obj) if isinstance(namespace, ThroughClass) else id(namespace)


def _class_reads(model: torch.nn.Module, names: set[str], found: dict) -> dict[tuple[int, str], CodeRead]:
    """Reads of ``names`` on the classes of the model's modules that define them (model code's
    classes), for code that reads them on a class (``type(module).FUSED``)."""
    reads = {}
    for cls in {type(m) for _, m in named_modules(model)} if names else ():
        for name in names:
            owner = next((c for c in cls.__mro__ if name in vars(c)), None)
            if owner is None or library_module(owner.__module__ or "") or (id(_class_namespace(owner)), name) in found:
                continue
            namespace = _class_namespace(owner)
            if callable(namespace[name]) or isinstance(namespace[name], (staticmethod, classmethod, property)):
                continue  # a method: replaced on the class, the attribute reads on the modules see it
            read = _read(f"{owner.__qualname__}.{name} (a class attribute the code reads on the class)", namespace, name, namespace[name])
            if read is not None:
                reads[(id(read.namespace), name)] = read
    return reads


_CLASS_NAMESPACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _class_namespace(cls: type) -> types.MappingProxyType:
    """A class's namespace, one object per class (``vars(cls)`` makes a new proxy each time), so its
    reads are found once and checked together."""
    try:
        return _CLASS_NAMESPACES[cls]
    except KeyError:
        return _CLASS_NAMESPACES.setdefault(cls, vars(cls))
    except TypeError:  # a class that takes no weak reference
        return vars(cls)


def _container_read(read: CodeRead, changed: bool, used: bool) -> CodeRead:
    """How a list, dict or set the code can read is compared (module docstring): one the code only
    fills in place by identity (a log, a registry); one it fills and also reads by its entries
    (a memo: whether an entry is there decides whether its work runs); any other by value when it
    is small and plain, else by its number of entries (another code's fill, through an alias or a
    library helper, still shows)."""
    value = read.now()
    if not isinstance(value, _MUTABLE) or isinstance(read.expected, OfType):
        return read
    if changed and not used:
        return dataclasses.replace(read, expected=value, test="is")
    if changed:
        return dataclasses.replace(read, expected=Entries(value, keys=True), test="==")
    table = RegistryContents(value) if read.test == "is" and isinstance(value, dict) else None
    if table is not None and table.dicts:  # a table of functions (an activation by name): an entry replaced runs other code
        return dataclasses.replace(read, expected=table, test="==")
    if read.test == "is":
        return dataclasses.replace(read, expected=Entries(value, keys=False), test="==")
    return read


class Entries:
    """The expected value of a container compared by its entries, not their values: equal to the
    same object holding as many entries, and with ``keys`` the same keys (a dict's keys, a set's
    items, up to :data:`MAX_COMPARED`). A memo that gains an entry, or a list that grows, is
    another situation; an entry's value replaced in place is not."""

    __slots__ = ("container", "size", "keys")

    def __init__(self, container: list | dict | set, keys: bool) -> None:
        self.container, self.size = container, len(container)
        self.keys = frozenset(container) if keys and isinstance(container, (dict, set)) and self.size <= MAX_COMPARED else None

    def __eq__(self, other: object) -> bool:
        if other is not self.container or len(other) != self.size:
            return False
        return self.keys is None or (other.keys() if isinstance(other, dict) else other) == self.keys

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self.container).__name__} with {len(self.container)} entries"


def _followed(
    model: torch.nn.Module, called: dict[str, set[str]], functions: list[Any]
) -> Iterator[tuple[types.FunctionType, list[tuple[str, CodeRead]]]]:
    """The model code the capture ran, with each function's reads: the called methods, the hooks, the
    call's function arguments, and the functions their globals and closures hold, transitively (up to
    :data:`MAX_FUNCTIONS`; not library code)."""
    seen: set[tuple[int, int]] = set()
    keys = _strings_read(model, called)  # a registry's functions under these keys may run
    todo: list[tuple[types.FunctionType, tuple[Any, str] | None]] = [
        *_called_methods(model, called), *_hooks(model),
        *(pair for value in functions for pair in _code_run_by(value, "a function the call passes")),
    ]
    while todo and len(seen) < MAX_FUNCTIONS:
        fn, runs_on = todo.pop()
        if (id(fn), id(runs_on and runs_on[0])) in seen or _is_library(fn):
            continue
        seen.add((id(fn), id(runs_on and runs_on[0])))
        reads = list(_reads_of(fn, runs_on))
        yield fn, reads
        for _, read in reads:
            value = read.expected.func if isinstance(read.expected, SamePartial) else read.expected
            held = value.functions_under(keys) if isinstance(value, RegistryContents) else (value,)
            todo += [(f, read.runs_on) for v in held for f in _functions_in(v)]


def _hooks(model: torch.nn.Module) -> Iterator[tuple[types.FunctionType, tuple[Any, str] | None]]:
    """The functions of the hooks on the model's modules (a hook runs in the call as its module's
    code does), with the object each runs on (:func:`_code_run_by`)."""
    for path, module in named_modules(model):
        for name in HOOK_DICTS:
            for i, hook in enumerate(list(getattr(module, name).values())):
                yield from _code_run_by(hook, f"{path or '<root>'}.{name}#{i}")


def _code_run_by(value: Any, path: str) -> Iterator[tuple[types.FunctionType, tuple[Any, str] | None]]:
    """The functions a callable runs, each with the object its first parameter is (``runs_on``):
    a bound method's object, a callable object's (``__call__`` of its class: a hook kept as an
    object with settings); a function's, a partial's: none."""
    if isinstance(value, types.MethodType) and _plain_object(value.__self__):
        yield from ((f, (value.__self__, path)) for f in _functions_in(value.__func__))
    elif callable(value) and _plain_object(value) and not isinstance(value, types.FunctionType):
        yield from ((f, (value, path)) for f in _functions_in(getattr(type(value), "__call__", None)))
    else:
        yield from ((f, None) for f in _functions_in(value))


def _called_methods(model: torch.nn.Module, called: dict[str, set[str]]) -> Iterator[tuple[types.FunctionType, tuple[Any, str] | None]]:
    """The functions behind the attributes the capture read on the model's modules, and on the
    objects they hold (keys ``"module path|held.path"``), that their classes define (methods,
    properties, static and class methods; not torch's own classes'), with what they run on: a
    class method its class (``cls.REPEATS``), a bound method a module holds its object
    (``self.n = settings.repeats``: what ``settings.repeats`` reads on ``self``, :func:`_code_run_by`);
    a module's own methods nothing (what they read on the module, the capture recorded)."""
    for key, names in called.items():
        owner = _owner_of(model, key)
        if owner is _GONE:
            continue
        path, _, held_path = key.partition("|")
        where = f"{path or '<root>'}{'.' + held_path if held_path else ''}"
        for name in names:
            held = vars(owner).get(name)
            if held is not None:  # a function the module holds (``self.chosen = chosen``): its code too
                yield from _code_run_by(held, f"{where}.{name}")
                continue
            cls = next((c for c in type(owner).__mro__ if name in vars(c)), None)
            if cls is not None and not cls.__module__.startswith(_LIBRARIES):
                value = vars(cls)[name]
                runs_on = (type(owner), f"type({where})") if isinstance(value, classmethod) else None
                yield from ((f, runs_on) for f in _functions_in(value))


_GONE = object()


def _owner_of(model: torch.nn.Module, key: str) -> Any:
    """The module at a ``called`` key's path, or the object it holds along its held path; ``_GONE``
    when it is no longer there."""
    path, _, held_path = key.partition("|")
    try:
        owner = module_at(model, path)
        for part in held_path.split(".") if held_path else ():
            owner = vars(owner)[part]
    except (AttributeError, KeyError, IndexError, ValueError, TypeError):  # gone since
        return _GONE
    return owner


def _strings_read(model: torch.nn.Module, called: dict[str, set[str]]) -> frozenset[str]:
    """The strings the capture read on the modules and the objects they hold (a config's
    ``_attn_implementation``): the keys by which the code may choose a function from a registry."""
    found = set()
    for key, names in called.items():
        owner = _owner_of(model, key)
        values = attribute(owner, "__dict__") or {}
        found.update(value for name in names if isinstance(value := values.get(name), str))
    return frozenset(found)


def _functions_in(value: Any) -> Iterator[types.FunctionType]:
    """The plain functions a class attribute or a held callable runs: a method (bound too), a static
    or class method, a property's getter, a ``functools.partial``'s function, an lru cache's, and
    the functions a decorator wraps (``__wrapped__``)."""
    while isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    elif isinstance(value, functools.cached_property):
        value = value.func
    if isinstance(value, functools._lru_cache_wrapper):  # a cached helper: the function it caches
        value = value.__wrapped__
    while isinstance(value, types.FunctionType):
        yield value
        value = getattr(value, "__wrapped__", None)


def importable(fn: Any) -> bool:
    """Whether a function can be found again by its module and qualified name (pickled by reference)."""
    found = sys.modules.get(getattr(fn, "__module__", None) or "")
    for part in (getattr(fn, "__qualname__", None) or "<lambda>").split("."):
        found = getattr(found, part, None)
    return found is fn


def _is_library(fn: types.FunctionType) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module.startswith(_LIBRARIES) or module == __name__ or library_module(module)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """A code object and the code objects nested in it (comprehensions, lambdas)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


@functools.lru_cache(maxsize=8192)  # code objects are immutable: disassembled once per process
def _instructions(code: types.CodeType) -> list[dis.Instruction]:
    """The code's instructions (shared by the scans below: do not change the list)."""
    return list(dis.get_instructions(code))


_WRITES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL", "STORE_DEREF", "DELETE_DEREF"})


@functools.lru_cache(maxsize=8192)  # code objects are immutable: scanned once per process
def _written(code: types.CodeType) -> frozenset[str]:
    """The globals and closure variables the code assigns (``global n; n += 1``, ``nonlocal``): the
    code's own bookkeeping (a call counter), which would otherwise make every call another situation."""
    return frozenset(i.argval for c in _codes(code) for i in _instructions(c) if i.opname in _WRITES)


@functools.lru_cache(maxsize=8192)
def _attributes_set(code: types.CodeType) -> frozenset[str]:
    """The attribute names the code assigns or deletes (``cfg.calls += 1``, ``self.x = v``)."""
    return frozenset(i.argval for c in _codes(code) for i in _instructions(c) if i.opname in ("STORE_ATTR", "DELETE_ATTR"))


@functools.lru_cache(maxsize=8192)
def _class_attributes_read(code: types.CodeType) -> frozenset[str]:
    """The attribute names the code reads on an object's class (``type(module).FUSED``,
    ``self.__class__.FUSED``): reads no attribute access on the object records."""
    names = set()
    for c in _codes(code):
        instructions = _instructions(c)
        for at, instruction in enumerate(instructions):
            if instruction.opname not in ("LOAD_ATTR", "LOAD_METHOD") or not at:
                continue
            before = instructions[at - 1]
            if before.opname == "LOAD_ATTR" and before.argval == "__class__":
                names.add(instruction.argval)
            elif before.opname == "CALL" and before.arg == 1:
                call = at - 2 if instructions[at - 2].opname == "PRECALL" else at - 1
                function = _container_of(instructions, call, 1)
                if function is not None and function.opname == "LOAD_GLOBAL" and function.argval == "type":
                    names.add(instruction.argval)
    return frozenset(names)


_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"})
_CONTAINER_WRITES = {"STORE_SUBSCR": 1, "DELETE_SUBSCR": 1, "STORE_SLICE": 2}  # operands pushed after the container
_MUTATORS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "sort", "reverse", "appendleft", "extendleft", "popleft", "__setitem__", "__delitem__", "__iadd__", "__ior__",
    "intersection_update", "difference_update", "symmetric_difference_update",
})


@dataclass(frozen=True)
class Uses:
    """How one code object uses the containers it names (:func:`_uses`): the globals and closure
    variables it changes in place and those it uses in any other way (reads an entry, tests
    membership, takes the length, passes on), and the same for attributes (``self.records``)."""

    names_changed: frozenset[str]
    names_used: frozenset[str]
    attributes_changed: frozenset[str]
    attributes_used: frozenset[str]


@functools.lru_cache(maxsize=8192)
def _uses(code: types.CodeType) -> Uses:
    """How ``code`` (nested code too) uses what it loads, from its bytecode. A loaded value is
    changed in place when a mutating method is looked up on it (``CACHE.setdefault``,
    ``SEEN.add(...)``, ``self.records.append``) or it is the container of a subscript assignment or
    deletion (``CACHE[key] = v``, ``del self.cache[k]``), found by walking back over the key's
    expression with the instructions' stack effects, with its other loads in that statement
    (addressing: ``self.norms[len(self.norms)] = v``); where that walk cannot tell (a jump, a
    ``COPY``/``SWAP`` as in ``CACHE[k] += 1``), every load of the statement counts as both changed
    and used. Every other load is a use: ``key in CACHE``, ``CACHE[key]``, ``len(self.mems)``,
    ``torch.cat(self.mems)``, ``self.cache.get(k)``."""
    loads: list[tuple[tuple[int, int], str, str]] = []  # (where, "name" or "attribute", name)
    changed: set[tuple[int, int]] = set()
    both: set[tuple[int, int]] = set()  # loads the walk could not place: changed and used
    for number, c in enumerate(_codes(code)):
        instructions = _instructions(c)
        for at, instruction in enumerate(instructions):
            where = (number, instruction.offset)
            if _kind(instruction) is not None:
                loads.append((where, _kind(instruction), instruction.argval))
            if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and instruction.argval in _MUTATORS and at:
                changed.update({(number, instructions[at - 1].offset), where})  # the method's lookup is no use
            elif instruction.opname in _CONTAINER_WRITES:
                container = _container_of(instructions, at, _CONTAINER_WRITES[instruction.opname])
                statement = instructions[_statement_start(instructions, at) : at]
                if container is None:
                    both.update((number, i.offset) for i in statement)
                else:  # with its loads in the same statement: addressing (``self.norms[len(self.norms)] = v``)
                    same = _kind(container), container.argval
                    changed.update((number, i.offset) for i in statement if i is container or (_kind(i), i.argval) == same)
    changed |= both

    def of(kind: str, wanted: bool) -> frozenset[str]:
        return frozenset(name for where, k, name in loads if k == kind and ((where in changed) == wanted or where in both))

    return Uses(of("name", True), of("name", False), of("attribute", True), of("attribute", False))


def _container_of(instructions: list[dis.Instruction], at: int, operands: int) -> dis.Instruction | None:
    """The instruction that loads the container a subscript write at ``at`` writes to (None when the
    bytecode before it is not a plain run of expressions): walk back over the ``operands`` key
    expressions, each of which leaves one more value on the stack than it takes."""
    height = 0
    for k in range(at - 1, -1, -1):
        instruction = instructions[k]
        if instruction.opname in ("COPY", "SWAP", "DUP_TOP", "ROT_TWO", "ROT_THREE") or _jumps(instruction):
            return None
        try:
            height += dis.stack_effect(instruction.opcode, instruction.arg if instruction.opcode >= dis.HAVE_ARGUMENT else None)
        except ValueError:
            return None
        if height == operands:
            return instructions[k - 1] if k and not instructions[k].is_jump_target else None
    return None


def _kind(instruction: dis.Instruction) -> str | None:
    return "name" if instruction.opname in _LOADS else "attribute" if instruction.opname == "LOAD_ATTR" else None


def _jumps(instruction: dis.Instruction) -> bool:
    return instruction.is_jump_target or instruction.opcode in dis.hasjrel or instruction.opcode in dis.hasjabs


def _statement_start(instructions: list[dis.Instruction], at: int) -> int:
    """The index of the first instruction of the line ``instructions[at]`` belongs to."""
    while at > 0 and _line_of(instructions[at]) is None:
        at -= 1
    return at


def _line_of(instruction: dis.Instruction) -> int | None:
    """The line an instruction starts (None: it continues the line before; 3.13 numbers every one)."""
    return instruction.line_number if sys.version_info >= (3, 13) else instruction.starts_line


@functools.lru_cache(maxsize=1024)
def attributes_read_beyond_updates(cls: type, library: bool) -> frozenset[str]:
    """The attribute names the methods of ``cls`` and its bases (torch's and the standard library's
    only with ``library``) load other than to update the same attribute in the same statement
    (``self.calls += 1``, ``self.total = self.total + n`` are updates; ``if self.calls % 2:``,
    ``self.fc(x) if self.on else x`` are reads). What a hook object or a module sets on itself only
    to keep count is its bookkeeping, not its situation; a value it also reads otherwise decides
    what it runs (``situation.py`` compares it)."""
    read: set[str] = set()
    for owner in cls.__mro__:
        if not library and library_module(getattr(owner, "__module__", None) or ""):
            continue
        for value in list(vars(owner).values()):
            for fn in _functions_in(value):
                for code in _codes(fn.__code__):
                    read |= _loads_beyond_updates(code)
    return frozenset(read)


@functools.lru_cache(maxsize=8192)
def _loads_beyond_updates(code: types.CodeType) -> frozenset[str]:
    """The attribute names ``code`` loads outside a statement that stores that attribute."""
    instructions = _instructions(code)
    starts = [at for at, i in enumerate(instructions) if at == 0 or _line_of(i) is not None] + [len(instructions)]
    read = set()
    for start, end in zip(starts, starts[1:]):
        statement = instructions[start:end]
        stored = {i.argval for i in statement if i.opname == "STORE_ATTR"}
        read |= {i.argval for i in statement if i.opname in ("LOAD_ATTR", "LOAD_METHOD") and i.argval not in stored}
    return frozenset(read)


def _reads_of(fn: types.FunctionType, runs_on: tuple[Any, str] | None = None) -> Iterator[tuple[str, CodeRead]]:
    """The globals ``fn``'s code names (those its module holds) and its closure's cells, as reads
    with the name the code uses: plain values and functions (other objects: modules, classes, a
    logger, are not followed); with ``runs_on``, the attributes it reads on its first parameter,
    the object (and path) it runs on (:func:`_attribute_reads`)."""
    namespace = fn.__globals__
    where = getattr(fn, "__module__", None) or "?"
    written = _written(fn.__code__)
    for name in {n for code in _codes(fn.__code__) for n in code.co_names}:
        if name in namespace:
            label = f"{where}.{name} (a global {fn.__qualname__} {'sets' if name in written else 'reads'})"
            read = (_assigned if name in written else _read)(label, namespace, name, namespace[name])
            if read is not None:
                yield name, read
    try:
        attributes = list(_attribute_reads(fn, runs_on))
    except Exception:  # noqa: BLE001 - an object whose namespace misbehaves (a proxy): its attributes unguarded
        attributes = []
    yield from attributes
    if hasattr(fn, "__wrapped__"):  # a decorator's wrapper: its cells hold the decorator's settings
        return
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        label = f"{fn.__qualname__}'s closure variable {name}"
        read = (_assigned if name in written else _read)(label, cell, None, value)
        if read is not None:
            yield name, read


def _attribute_reads(fn: types.FunctionType, runs_on: tuple[Any, str] | None = None) -> Iterator[tuple[str, CodeRead]]:
    """The attributes ``fn``'s code reads on a module, a class or a plain object it names as a
    global, a closure variable or a parameter's default, directly or through a local it assigns once
    (``cfg.USE_EXTRA``, ``layers.attention(...)``, ``pkg.sub.FLAG``, ``os.environ.get(...)``,
    ``Block.FUSED``, ``Rotary.apply(...)``, ``CFG.deep.n``, ``opts.extra`` with ``opts=DEFAULTS``,
    ``args = get_args(); args.flag`` where ``get_args`` returns a global), as reads of the namespace
    that holds each value along the chain (the objects and modules on the way by identity), named
    ``.attribute`` (the code uses it as an attribute, see :func:`_uses`); with ``runs_on``, those
    it reads on its first parameter (``self.on`` in ``SETTINGS.enabled()``, the object ``runs_on``
    holds). Not torch's or fxflops' modules, classes and objects; of the standard library, only the
    values of :data:`_STATE_MODULES` and plain namespaces."""
    yield from _super_reads(fn)
    yield from _getter_reads(fn)
    for code in _codes(fn.__code__):
        instructions = _instructions(code)
        yield from _torch_functions(fn, instructions)
        assigned = _assigned_once(fn, code, instructions, runs_on)
        for at, instruction in enumerate(instructions):
            found = _root(fn, code, instructions, at, assigned)
            if found is None:
                continue
            (namespace, key, owner), after = found
            path = runs_on[1] if runs_on and owner is runs_on[0] and instruction.opname == "LOAD_FAST" else instruction.argval
            chain = list(_chain(fn, owner, path, instructions[after:]))
            if chain and isinstance(namespace, InContext):  # another object set in the calling context
                label = f"{instruction.argval}.get() (the object {fn.__qualname__} reads attributes of, in this context)"
                yield "", CodeRead(label, namespace, key, owner, "is")
            elif chain and namespace is not None:  # the global or closure variable rebound
                yield "", CodeRead(f"{instruction.argval} (an object {fn.__qualname__} reads attributes of)", namespace, key, owner, "is")
            yield from chain


def _torch_functions(fn: types.FunctionType, instructions: list[dis.Instruction]) -> Iterator[tuple[str, CodeRead]]:
    """The functions of torch's modules the code calls through a module it names as a global
    (``F.scaled_dot_product_attention``, ``torch.nn.functional.linear``, ``torch.matmul``), by
    identity on the module that holds each: one patched in its module (torch's context parallelism
    replaces ``F.scaled_dot_product_attention`` with a ring attention inside its context; a user's
    ``F.linear = lora_linear``) runs other work than the traced one. A function imported by name
    (``from torch import matmul``) is a global, compared as globals are."""
    for at, instruction in enumerate(instructions):
        if instruction.opname != "LOAD_GLOBAL":
            continue
        module, path = fn.__globals__.get(instruction.argval), instruction.argval
        if not isinstance(module, types.ModuleType) or not _of_torch(module.__name__):
            continue
        for step in instructions[at + 1 :]:
            namespace = vars(module)
            if step.opname not in ("LOAD_ATTR", "LOAD_METHOD") or step.argval not in namespace:
                break
            value, path = namespace[step.argval], f"{path}.{step.argval}"
            if isinstance(value, types.ModuleType) and _of_torch(value.__name__):
                module = value
                continue
            if callable(value) and not isinstance(value, type):
                yield "." + step.argval, CodeRead(f"{path} (called by {fn.__qualname__})", namespace, step.argval, value, "is")
            break


def _torch_module_functions(model: torch.nn.Module) -> Iterator[tuple[str, CodeRead]]:
    """The torch functions the forwards of torch's own module classes in the model call through a
    module (``nn.Linear.forward`` calls ``F.linear``, ``nn.Conv2d``'s ``_conv_forward`` calls
    ``F.conv2d``), and the methods of the class that forward names: one patched in its module (a
    low-rank adapter's ``F.linear``) runs other work in every such layer. Not their other reads
    (torch's code is not walked)."""
    seen: set[int] = set()
    for _, module in named_modules(model):
        cls = type(module)
        forward = getattr(cls, "forward", None)
        if id(cls) in seen or not isinstance(forward, types.FunctionType) or not _of_torch(forward.__module__ or ""):
            continue
        seen.add(id(cls))
        named = (getattr(cls, name, None) for name in forward.__code__.co_names)
        for fn in (forward, *(f for f in named if isinstance(f, types.FunctionType) and _of_torch(f.__module__ or ""))):
            yield from _torch_functions(fn, _instructions(fn.__code__))


def _of_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def _super_reads(fn: types.FunctionType) -> Iterator[tuple[str, CodeRead]]:
    """The methods and attributes ``fn`` reads through ``super()`` (``super().forward(x)``), by
    identity on the class after ``fn``'s own in its MRO that defines them, torch's classes too: a
    base class's method patched (``nn.Linear.forward`` by a library) runs in every subclass calling
    it so, and no attribute read on the module sees it (the subclass defines its own)."""
    code = fn.__code__
    if "__class__" not in code.co_freevars or not fn.__closure__:
        return
    try:
        cls = fn.__closure__[code.co_freevars.index("__class__")].cell_contents
    except ValueError:  # an empty cell
        return
    if not isinstance(cls, type):
        return
    for name in _super_attributes(code):
        mro = cls.__mro__
        owner = next((c for c in mro[mro.index(cls) + 1 :] if name in vars(c)), None)
        if owner is not None and owner not in TORCH_BASES:
            namespace = _class_namespace(owner)
            yield "." + name, CodeRead(f"{owner.__qualname__}.{name} (read through super() by {fn.__qualname__})", namespace, name, namespace[name], "is")


def _getter_reads(fn: types.FunctionType) -> Iterator[tuple[str, CodeRead]]:
    """The torch settings ``fn``'s code reads: by calling a getter without arguments
    (``torch.get_num_threads()``, ``torch.get_float32_matmul_precision()``,
    ``dist.is_initialized()``, ``dist.get_world_size()``; reached from a global through modules,
    or imported by name), or as a flag of ``torch.backends`` (``torch.backends.cudnn.deterministic``,
    ``torch.backends.cuda.matmul.allow_tf32``: properties that read the setting); each compared by
    the value it has per call (:data:`TORCH_GETTERS`): a branch on one is baked into the trace as a
    flag is. Only getters of :func:`_torch_getter`, and only plain values (a tensor, a stream: not
    compared)."""
    for code in _codes(fn.__code__):
        instructions = _instructions(code)
        for at, instruction in enumerate(instructions):
            if instruction.opname != "LOAD_GLOBAL" or instruction.argval not in fn.__globals__:
                continue
            value, after, path, holder = fn.__globals__[instruction.argval], at + 1, instruction.argval, None
            while after < len(instructions) and instructions[after].opname in ("LOAD_ATTR", "LOAD_METHOD") and _setting_holder(value):
                holder, name = value, instructions[after].argval
                value, path, after = _setting(holder, name), f"{path}.{name}", after + 1
            if _call_without_arguments(instructions, after) is not None:
                if not _torch_getter(value):
                    continue
                key, label = value, f"{path}()"
            elif holder is not None and _backends(holder) and isinstance(value, _FLAGS):
                key, label = (holder, name), path
            else:
                continue
            now = TORCH_GETTERS[key]
            if now is _RAISED or plain(now):
                yield "", CodeRead(f"{label} (a torch setting {fn.__qualname__} reads)", TORCH_GETTERS, key, now, "==")


_FLAGS = (bool, int, float, str)


def _setting_holder(value: Any) -> bool:
    """A module (whose attributes lead to a getter or a flag), or a flag holder of ``torch.backends``
    (``torch.backends.cuda.matmul``)."""
    return isinstance(value, types.ModuleType) or _backends(value)


def _backends(holder: Any) -> bool:
    """Whether ``holder`` is a module of ``torch.backends`` or an object of one's classes: its
    attributes are process-wide settings (properties reading them, ``ContextProp``)."""
    name = holder.__name__ if isinstance(holder, types.ModuleType) else type(holder).__module__
    return isinstance(name, str) and name.startswith("torch.backends")


def _setting(holder: Any, name: str) -> Any:
    """``holder.name`` as the code reads it: a module's global, or a ``torch.backends`` property
    (read; None where reading raises)."""
    if not _backends(holder):
        return vars(holder).get(name)
    try:
        return getattr(holder, name)
    except Exception:  # noqa: BLE001 - a setting this build cannot read: not compared
        return None


def _torch_getter(value: Any) -> bool:
    """A function of torch's that reads a process-wide setting without touching a device: named
    ``get_``, ``is_``, ``are_`` or ``has_`` in ``torch`` itself, ``torch.backends`` or
    ``torch.distributed``. Not the settings the call's mode key holds already (the ``..._enabled``
    modes: grad, inference, autocast, SDPA backends, deterministic algorithms; the default dtype),
    which model code may switch inside its own forward, nor anything of a device module
    (``torch.cuda.current_device()`` would initialise one) or of the compiler and tracers."""
    name, module = getattr(value, "__name__", None), getattr(value, "__module__", None)
    if not callable(value) or isinstance(value, type) or not isinstance(name, str) or not isinstance(module, str):
        return False
    if module != "torch" and not module.startswith(("torch.backends.", "torch.distributed.")):
        return False
    return name.startswith(("get_", "is_", "are_", "has_")) and not name.endswith("_enabled") and name != "get_default_dtype"


class _Raised:
    """What a getter that raised returns in :data:`TORCH_GETTERS` (``dist.get_rank()`` before the
    process group exists): equal only to itself."""

    def __repr__(self) -> str:
        return "an exception"


_RAISED = _Raised()


class _TorchGetters(collections.abc.Mapping):
    """The values of torch's settings, as a namespace the state check reads like a module's globals:
    ``TORCH_GETTERS[torch.get_num_threads]`` calls the getter, ``TORCH_GETTERS[(cudnn,
    "deterministic")]`` reads the flag (:data:`_RAISED` when either raises)."""

    def __getitem__(self, getter: Any) -> Any:
        try:
            return getattr(*getter) if type(getter) is tuple else getter()
        except Exception:  # noqa: BLE001 - a setting that cannot be read now: not the traced one
            return _RAISED

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0


TORCH_GETTERS = _TorchGetters()


TORCH_BASES = frozenset({object, torch.nn.Module})  # their attributes are torch's machinery, not model state (``super().__init__``)


@functools.lru_cache(maxsize=8192)
def _super_attributes(code: types.CodeType) -> frozenset[str]:
    """The attribute names the code loads on ``super()`` (``super().forward``: a call of ``super``
    with no arguments, then the load; ``LOAD_SUPER_ATTR`` from Python 3.12)."""
    instructions = _instructions(code)
    names = set()
    for at, instruction in enumerate(instructions):
        if instruction.opname == "LOAD_SUPER_ATTR":
            names.add(instruction.argval)
        elif instruction.opname == "LOAD_GLOBAL" and instruction.argval == "super":
            after = _call_without_arguments(instructions, at + 1)
            if after is not None and after < len(instructions) and instructions[after].opname in ("LOAD_ATTR", "LOAD_METHOD"):
                names.add(instructions[after].argval)
    return frozenset(names)


_Root = tuple[Any, "str | None", Any]  # (namespace or cell or None, key, value)


def _root(
    fn: types.FunctionType, code: types.CodeType, instructions: list[dis.Instruction], at: int, assigned: dict[str, _Root]
) -> tuple[_Root, int] | None:
    """The value the instructions at ``at`` load, when its attributes are followed, with where it
    lives and the index after them: a global (the function's module namespace and the name), what
    a global getter returns (``get_args()``: its module's namespace and the global it returns), a
    closure cell of ``fn`` (the cell and None), or a local of :func:`_assigned_once`."""
    instruction, own = instructions[at], code is fn.__code__
    name, after = instruction.argval, at + 1
    if instruction.opname == "LOAD_GLOBAL" and name in fn.__globals__:
        root: _Root = (fn.__globals__, name, fn.__globals__[name])
        call = _call_without_arguments(instructions, after)
        got = _call_without_arguments(instructions, after + 1) if _loads(instructions, after, "get") else None
        if isinstance(root[2], contextvars.ContextVar) and got is not None:  # ``CFG.get().deep``: the object it holds
            namespace = InContext(root[2])
            root, after = (namespace, "value", _seen_in_capture(root[2])), got
        elif call is not None:
            returned = _returned_global(root[2])
            if returned is None:
                return None
            root, after = returned, call
    elif instruction.opname == "LOAD_DEREF" and own and name in code.co_freevars and fn.__closure__:
        cell = fn.__closure__[code.co_freevars.index(name)]
        try:
            root = (cell, None, cell.cell_contents)
        except ValueError:  # an empty cell
            return None
    elif instruction.opname == "LOAD_FAST" and name in assigned:
        root = assigned[name]
    else:
        return None
    if type(root[2]) in (dict, list, tuple):  # ``REGISTRY["vit"].depth``, ``FLAGS[0].on``: compared as a global is
        return (None, None, root[2]), after
    return (root, after) if _followed_owner(root[2]) else None


def _loads(instructions: list[dis.Instruction], at: int, name: str) -> bool:
    """Whether ``instructions[at]`` loads attribute or method ``name``."""
    return at < len(instructions) and instructions[at].opname in ("LOAD_ATTR", "LOAD_METHOD") and instructions[at].argval == name


def _seen_in_capture(var: contextvars.ContextVar) -> Any:
    """What ``var.get()`` returns in a capture's context for the calling context's value: a flag,
    number or string as it is; otherwise (an object, unset) its default, or :data:`_UNSET`
    (``capture/ambient.flags_context``)."""
    value = _value_of(var)
    return value if traced_context_value(value) else contextvars.Context().run(_value_of, var)


class ThroughClass:
    """An object's attributes as ``obj.name`` reads those its ``__dict__`` did not hold when the
    code was walked: its class's default (``FLAGS[0].on`` with ``on = False`` on the class), a
    slot's value, what its ``__getattr__`` resolves, and the object's own value once it gets one
    (the class's changed, or shadowed, is another situation). Checked per call with
    ``operator.attrgetter`` on the object (``situation.py``); a failing lookup reads as absent."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self.obj, key)
        except Exception:  # noqa: BLE001 - absent however it says so
            raise KeyError(key) from None

    def __contains__(self, key: str) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True


class ThreadAttributes:
    """A ``threading.local``'s attributes as a namespace: those of the calling thread (KeyError
    where it has none by that name), so that a read through it (``LOCAL.cfg``) compares what each
    calling thread holds, not what the thread that walked the code held."""

    __slots__ = ("local",)

    def __init__(self, local: threading.local) -> None:
        self.local = local

    def __getitem__(self, key: str) -> Any:
        return vars(self.local)[key]

    def __contains__(self, key: str) -> bool:
        return key in vars(self.local)


class InContext:
    """A context variable as a namespace of one key, ``"value"``: what ``var.get()`` returns in the
    calling context (KeyError where it is unset without a default). Code reading attributes of the
    object a context variable holds (``CFG.get().deep``) is guarded by ``namespace["value"] is``
    the object the capture saw: the default (a capture's context does not hold the caller's
    objects, ``capture/ambient.py``), so a call made with another object set is not the traced one."""

    __slots__ = ("var",)

    def __init__(self, var: contextvars.ContextVar) -> None:
        self.var = var

    def __getitem__(self, key: str) -> Any:
        value = _value_of(self.var)
        if value is _UNSET:
            raise KeyError(key)
        return value


def _assigned_once(
    fn: types.FunctionType, code: types.CodeType, instructions: list[dis.Instruction], runs_on: tuple[Any, str] | None = None
) -> dict[str, _Root]:
    """The locals that stand for a followed value: the function's parameters with a default (the
    default; the caller may pass another, so not where it lives), its first parameter with
    ``runs_on`` (the object a method runs on), and the locals the code assigns once, from a global,
    a getter's result or a closure variable (``args = get_args()``)."""
    found: dict[str, _Root] = {name: (None, None, value) for name, value in _defaults(fn).items()} if code is fn.__code__ else {}
    stores = collections.Counter(i.argval for i in instructions if i.opname in ("STORE_FAST", "DELETE_FAST"))
    if runs_on is not None and code is fn.__code__ and code.co_argcount and not stores[code.co_varnames[0]]:
        found[code.co_varnames[0]] = (None, None, runs_on[0])
    for at, instruction in enumerate(instructions):
        if instruction.opname != "STORE_FAST" or stores[instruction.argval] != 1 or instruction.argval in found:
            continue
        for start in range(max(at - 3, 0), at):
            root = _root(fn, code, instructions, start, {})
            if root is not None and root[1] == at:
                found[instruction.argval] = root[0]
                break
    return found


def _call_without_arguments(instructions: list[dis.Instruction], at: int) -> int | None:
    """The index after a call with no arguments starting at ``at`` (``PRECALL 0; CALL 0``), or None."""
    if at < len(instructions) and instructions[at].opname == "PRECALL" and instructions[at].arg == 0:
        at += 1
    if at < len(instructions) and instructions[at].opname == "CALL" and instructions[at].arg == 0:
        return at + 1
    return None


def _returned_global(getter: Any) -> _Root | None:
    """Where the global a getter of model code returns lives (``def get_args(): return _ARGS``; an
    ``lru_cache``'d one returns what its function returned: the object, read as it is now)."""
    if isinstance(getter, functools._lru_cache_wrapper):
        getter = getter.__wrapped__
    if not isinstance(getter, types.FunctionType) or _is_library(getter):
        return None
    name = _returned_name(getter.__code__)
    return (getter.__globals__, name, getter.__globals__[name]) if name in getter.__globals__ else None


@functools.lru_cache(maxsize=8192)
def _returned_name(code: types.CodeType) -> str | None:
    """The global a function without parameters returns at its only return, or None."""
    instructions = _instructions(code)
    returns = [at for at, i in enumerate(instructions) if i.opname.startswith("RETURN")]
    if code.co_argcount or code.co_kwonlyargcount or len(returns) != 1 or instructions[returns[0]].opname != "RETURN_VALUE":
        return None
    before = instructions[returns[0] - 1]
    return before.argval if before.opname == "LOAD_GLOBAL" else None


def _defaults(fn: types.FunctionType) -> dict[str, Any]:
    """The function's parameters that have a default, with it."""
    code = fn.__code__
    positional = code.co_varnames[: code.co_argcount]
    found = dict(zip(positional[len(positional) - len(fn.__defaults__ or ()) :], fn.__defaults__ or ()))
    return {**found, **(fn.__kwdefaults__ or {})}


def _chain(fn: types.FunctionType, owner: Any, path: str, following: list[dis.Instruction]) -> Iterator[tuple[str, CodeRead]]:
    """The reads along a chain of attributes and constant dict keys from ``owner`` (``CFG.deep.n``,
    ``REGISTRY["vit"].depth``): each module, object or dict on the way by identity, the last
    attribute's value as :func:`_read` compares it (a dict's last entry is the dict's: a memo's
    entries are compared as its keys, :func:`_container_read`)."""
    at = 0
    while at < len(following):
        step, owner_path = following[at], path
        if step.opname in ("LOAD_ATTR", "LOAD_METHOD") and _followed_owner(owner):
            name, path, used_as, at = step.argval, f"{path}.{step.argval}", "." + step.argval, at + 1
            if isinstance(owner, type):
                holder = _class_namespace(next((c for c in owner.__mro__ if name in vars(c)), object))
            elif isinstance(owner, threading.local):
                holder = ThreadAttributes(owner)
            else:
                holder = attribute(owner, "__dict__")
                holder = holder if isinstance(holder, dict) else ThroughClass(owner)  # slots: through the class
            if name not in holder and not isinstance(owner, (type, types.ModuleType, threading.local)):
                defining = next((c for c in type(owner).__mro__ if name in vars(c)), None)
                if defining is not None and isinstance(vars(defining)[name], METHODS):  # by identity on its class
                    holder = _class_namespace(defining)
                else:  # a class default, a slot, a name __getattr__ resolves: as the object reads it
                    holder = ThroughClass(owner)
        elif _constant_key(following, at, str) and type(owner) is dict or _constant_key(following, at, int) and type(owner) in (list, tuple):
            name, path, used_as, at, holder = step.argval, f"{path}[{step.argval!r}]", "", at + 2, owner
        else:
            return
        if not _holds(holder, name):
            return  # an attribute the object makes on the fly, a missing key, an index past the end
        value, label = holder[name], f"{path} (read by {fn.__qualname__})"
        if isinstance(value, types.ModuleType) or _plain_object(value) or _subscripted(value, following, at):
            yield used_as, CodeRead(label, holder, name, value, "is")
            owner = value
            continue
        if holder is owner:  # a dict's entry (``CACHE["gram"]``): the dict is compared as a container
            return
        if isinstance(value, METHODS) and not isinstance(owner, types.ModuleType):
            # a method or property read on an object or class (``SETTINGS.enabled()``, ``Rotary.apply(x)``):
            # by identity on its class, its function walked on the object it runs on (:func:`_runs_on`)
            if not library_module(_module_name(owner)):
                yield used_as, CodeRead(label, holder, name, value, "is", _runs_on(value, owner, owner_path))
        elif not (library_module(_module_name(owner)) and callable(value)):
            read = _read(label, holder, name, value)
            if read is not None:
                yield used_as, read
        return


METHODS = (staticmethod, classmethod, property, functools.cached_property, types.FunctionType)  # walked where they run (situation.py too)


def _runs_on(method: Any, owner: Any, path: str) -> tuple[Any, str] | None:
    """What a method read on ``owner`` (at ``path``) gets as its first parameter: the class for a
    class method, nothing for a static method or a function a class holds read on the class, the
    object for a method or property read on an object."""
    if isinstance(method, staticmethod):
        return None
    if isinstance(method, classmethod):
        return (owner, path) if isinstance(owner, type) else (type(owner), f"type({path})")
    return None if isinstance(owner, type) else (owner, path)


def _constant_key(instructions: list[dis.Instruction], at: int, kind: type) -> bool:
    """Whether ``instructions[at:]`` subscript the value before with a constant key of ``kind``
    (``["vit"]``, ``[0]``; not a bool)."""
    return (
        at + 1 < len(instructions) and instructions[at].opname == "LOAD_CONST" and type(instructions[at].argval) is kind
        and instructions[at + 1].opname == "BINARY_SUBSCR"
    )


def _subscripted(value: Any, instructions: list[dis.Instruction], at: int) -> bool:
    """Whether ``value`` is a dict the code reads a constant key of next (``REGISTRY["vit"]``), or
    a list or tuple it reads a constant index of (``FLAGS[0]``)."""
    if type(value) is dict:
        return _constant_key(instructions, at, str)
    return type(value) in (list, tuple) and _constant_key(instructions, at, int)


def _holds(holder: Any, name: Any) -> bool:
    """Whether a namespace holds ``name``: a list's or tuple's index within it, another's key."""
    if type(holder) in (list, tuple):
        return -len(holder) <= name < len(holder)
    return name in holder


def _followed_owner(owner: Any) -> bool:
    """Whether the attributes read on a module, a class or an object are followed: model code's
    (not an enumeration's members, which are constants), and of the standard library the values of
    :data:`_STATE_MODULES`, plain namespaces (``types.SimpleNamespace``, ``argparse.Namespace``) and
    thread-local objects (``LOCAL.cfg.deep``: the calling thread's, :class:`ThreadAttributes`)."""
    if isinstance(owner, enum.EnumMeta):
        return False
    if isinstance(owner, threading.local):
        return True
    if isinstance(owner, (types.ModuleType, type)):
        name = _module_name(owner)
        return not library_module(name) or name in _STATE_MODULES
    return _plain_object(owner)


def _plain_object(value: Any) -> bool:
    """An object whose attributes are settings the code may read (a config instance, a namespace of
    parsed arguments): one with a ``__dict__`` that is not a module, class, function, tensor or
    ``nn.Module``, of a class of model code or a plain namespace."""
    if isinstance(value, _NOT_OBJECTS) or isinstance(value, type) or (attribute(value, "__dict__") is None and not slot_descriptors(type(value))):
        return False
    module = type(value).__module__ or ""
    return module in _NAMESPACE_MODULES or not library_module(module)



_NOT_OBJECTS = (*NOT_HELD, functools.partial)  # what capture/reads.py does not record reads on, and partials
_NAMESPACE_MODULES = frozenset({"types", "argparse"})  # SimpleNamespace, Namespace: plain attribute holders


def _module_name(owner: Any) -> str:
    """The module a module is, or that defines a class or an object's class."""
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return (owner if isinstance(owner, type) else type(owner)).__module__ or ""


_STATE_MODULES = frozenset({"os"})  # the standard library module whose values model code may branch on (``os.environ``)


_MUTABLE = (list, dict, set)


def _assigned(label: str, namespace: Any, key: str | None, value: Any) -> CodeRead:
    """A global or closure variable the code assigns: compared by its type (``None`` and flags by
    value), not its value. A counter (``calls += 1``) stays one situation; a lazily made value
    (``if _TABLE is None: _TABLE = w @ w.T``), whose work runs only while it is unset, is another."""
    if isinstance(value, (bool, type(None))):
        return CodeRead(label, namespace, key, value, "is")
    return CodeRead(label, namespace, key, OfType(value), "==")


class OfType:
    """The expected value of a variable the code assigns: equal to any value of the same type."""

    __slots__ = ("type",)

    def __init__(self, value: Any) -> None:
        self.type = type(value)

    def __eq__(self, other: object) -> bool:
        return type(other) is self.type

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"a {self.type.__name__}"


class SamePartial:
    """The expected value of a ``functools.partial`` whose arguments are plain values
    (``partial(F.gelu, approximate="tanh")``): equal to a partial of the same type and function
    holding equal arguments (its ``keywords`` dict can change in place). Keying it whole took 6 µs per
    call; this takes a few hundred nanoseconds."""

    __slots__ = ("kind", "func", "args", "keywords")

    def __init__(self, value: functools.partial) -> None:
        self.kind, self.func, self.args, self.keywords = type(value), value.func, copied(value.args), copied(value.keywords)

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is self.kind and other.func is self.func and other.args == self.args and other.keywords == self.keywords
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"partial({getattr(self.func, '__name__', self.func)}, {self.args}, {self.keywords})"


class ContextValue:
    """The expected value of a ``contextvars.ContextVar`` the code reads (``if USE_FUSED.get():``): the
    same variable, holding in the calling context the flag, number or string the trace saw (a
    capture's context holds the caller's, ``capture/ambient.py``), or, where the trace saw none, no
    such value. An object (transformers' output collector of a running call, which its hooks append
    to) is not compared: the trace sees it unset. A ``ContextVar.get()`` per call, no copy."""

    __slots__ = ("var", "key", "seen")

    def __init__(self, var: contextvars.ContextVar) -> None:
        self.seen = _value_of(var)
        self.var, self.key = var, _flag_key(self.seen)

    def __eq__(self, other: object) -> bool:
        if other is not self.var:
            return False
        value = _value_of(other)
        return value is self.seen or _flag_key(value) == self.key  # the same object: the common case, at once

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{self.var.name} = {'unset' if self.key is None else self.key[-1]!r}"


class ThreadValues:
    """The expected value of a ``threading.local`` the code reads (``if LOCAL.fused:``): the same
    object holding, in the calling thread, the flags, numbers and strings it held in the traced one
    (none added, none removed: ``getattr(LOCAL, "fused", False)``). Objects it holds (a thread's
    bookkeeping, a per-call record) are not compared, as a context variable's are not."""

    __slots__ = ("local", "values")

    def __init__(self, local: threading.local) -> None:
        self.local, self.values = local, _flags_of(local)

    def __eq__(self, other: object) -> bool:
        return other is self.local and _flags_of(other) == self.values

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"a threading.local with {self.values!r}"


_UNSET = object()  # a context variable without a value


def _value_of(var: contextvars.ContextVar) -> Any:
    """What ``var.get()`` returns in the calling context (its default where unset), or :data:`_UNSET`."""
    try:
        return var.get()
    except LookupError:
        return _UNSET


def _flag_key(value: Any) -> Any:
    """A flag, number or string as a call key keys it (by type: ``True`` is not ``1``; a NaN by its
    bits, equal to a NaN); None for anything a capture does not see (unset, an object)."""
    return value_key(value) if traced_context_value(value) else None


def _flags_of(local: threading.local) -> dict[str, Any]:
    """The keys of the flags, numbers and strings a thread-local object holds in the calling thread."""
    return {name: key for name, value in vars(local).items() if (key := _flag_key(value)) is not None}


def definition(value: Any) -> Any:
    """What a function the code reads is, where a copy or a load cannot keep its identity: its
    kind, module, qualified name and code, recursively through a partial's or a bound method's
    function (a helper replaced by another function, a lambda, a partial or a builtin is another
    definition, one and the same function in another process is not); None for a value that is
    not a function."""
    if isinstance(value, SamePartial):  # how a partial of plain arguments is read
        return ("partial", value.kind, definition(value.func), value.args, value.keywords)
    if isinstance(value, functools.partial):
        arguments = (value.args, value.keywords) if plain(value.args) and plain(value.keywords) else (None, None)
        return ("partial", type(value), definition(value.func), *arguments)
    if isinstance(value, types.MethodType):
        return ("method", type(value.__self__).__qualname__, definition(value.__func__))
    if isinstance(value, functools._lru_cache_wrapper):
        return ("lru_cache", definition(value.__wrapped__))
    if isinstance(value, types.FunctionType):
        return ("function", value.__module__, value.__qualname__, _code_definition(value.__code__))
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", getattr(value, "__module__", None), value.__qualname__)
    return None


def _code_definition(code: types.CodeType) -> tuple:
    """A code object's bytecode, names and constants (nested code objects the same way; a frozenset
    constant sorted, as its order follows string hashing, which differs between processes)."""
    return (code.co_code, code.co_names, tuple(
        _code_definition(c) if isinstance(c, types.CodeType) else sorted(map(repr, c)) if isinstance(c, frozenset) else repr(c)
        for c in code.co_consts
    ))


def _read(label: str, namespace: Any, key: str | None, value: Any) -> CodeRead | None:
    if isinstance(value, type):  # a class the code builds or tests against: not state a count depends on
        return None
    if isinstance(value, (bool, type(None))):
        return CodeRead(label, namespace, key, value, "is")
    if isinstance(value, _MUTABLE):  # by value; by identity when filled in place (code_reads) or large
        return CodeRead(label, namespace, key, copied(value), "==") if plain(value, MAX_COMPARED) else CodeRead(label, namespace, key, value, "is")
    if plain(value):
        return CodeRead(label, namespace, key, copied(value), "==")
    if isinstance(value, torch.Tensor):  # a weight or a table the code uses: the program holds its shape
        return CodeRead(label, namespace, key, SameTensor(value), "==")
    if isinstance(value, functools.partial) and plain(value.args) and plain(value.keywords):
        return CodeRead(label, namespace, key, SamePartial(value), "==")  # its settings, changed in place too
    if isinstance(value, contextvars.ContextVar):  # USE_FUSED.get(): its value in the calling context
        return CodeRead(f"{label} (its value in this context)", namespace, key, ContextValue(value), "==")
    if isinstance(value, threading.local):  # LOCAL.flag: the calling thread's attributes
        return CodeRead(f"{label} (this thread's attributes)", namespace, key, ThreadValues(value), "==")
    if value is os.getenv:  # a function of the environment: its contents, as os.environ.get(...) reads them
        return CodeRead(f"{label} (os.environ)", vars(os), "environ", RegistryContents(os.environ), "==")
    if isinstance(value, _CALLABLES):  # a helper patched in: another situation
        return CodeRead(label, namespace, key, value, "is")
    if isinstance(value, collections.abc.Mapping):  # a registry object, not a dict: the dicts it keeps
        return CodeRead(label, namespace, key, RegistryContents(value), "==")
    return None


class SameTensor:
    """The expected value of a tensor the code reads from outside the model (a module-level table, a
    closure's weight): the same tensor with the same shape (another one, or one resized in place,
    may have other sizes than the trace's constant had)."""

    __slots__ = ("tensor", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape = tensor, tensor.shape

    def __eq__(self, other: object) -> bool:
        return other is self.tensor and other.shape == self.shape

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"the tensor of shape {tuple(self.shape)}"


_CALLABLES = (  # compared by identity (the functions among them are walked)
    types.FunctionType, functools._lru_cache_wrapper, functools.partial, types.MethodType, types.BuiltinFunctionType,
)
_BY_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, type, functools.partial, functools._lru_cache_wrapper)


class RegistryContents:
    """The expected value of a mapping that is not a dict, such as transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (which keeps its entries in a class-level and an instance dict), or
    of a dict of functions (an ``ACT2FN``-style table): the same object, each dict of functions or
    plain values it (or it and its classes) keep equal to a copy (functions by identity: an
    attention function registered over ``"sdpa"`` after the first call is another situation)."""

    __slots__ = ("registry", "dicts", "copies")

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.dicts = tuple(
            d for d in _held_dicts(registry)
            if len(d) <= MAX_COMPARED and all(isinstance(v, _BY_IDENTITY) or plain(v) for v in d.values())
        )
        self.copies = tuple(dict(d) for d in self.dicts)

    def __eq__(self, other: object) -> bool:
        return other is self.registry and all(d == c for d, c in zip(self.dicts, self.copies))

    def functions_under(self, keys: frozenset[str]) -> list[Any]:
        """The functions it keeps under ``keys``: model code the call may run (an attention function
        chosen by a config's string), whose own reads are the call's too."""
        return [v for copy in self.copies for k, v in copy.items() if k in keys and isinstance(v, types.FunctionType)]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self.registry).__name__} with {sum(map(len, self.dicts))} entries"


def _held_dicts(registry: Any) -> list[dict]:
    """A dict itself; else the dicts a registry object and its classes keep (not their dunders)."""
    if isinstance(registry, dict):
        return [registry]
    namespaces = [*([vars(registry)] if hasattr(registry, "__dict__") else []), *(vars(c) for c in type(registry).__mro__)]
    return [d for namespace in namespaces for name, d in namespace.items() if not name.startswith("__") and type(d) is dict]


_PLAIN_CONTAINERS = (tuple, list, dict, set, frozenset)


def plain(value: Any, size: int = 64) -> bool:
    """Numbers, strings, flags, dtypes, enums, and small containers of them: compared by value."""
    if isinstance(value, SCALARS):
        return True
    if isinstance(value, _PLAIN_CONTAINERS) and len(value) <= size:
        items = value.items() if isinstance(value, dict) else ((v, v) for v in value)
        return all(plain(k, 0) and plain(v, size // 4) for k, v in items)
    return False


def copied(value: Any) -> Any:
    """A plain value as it is now (containers copied: the user's may change in place)."""
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, (list, set)):
        return type(value)(copied(v) for v in value)
    return value
