"""The part of a call's situation that lives in the model's Python code: globals and closures.

A trace runs the model's Python once, and what that Python read from outside the model is baked
into the program like a constant: a module-level flag (``REPEATS = 3``, ``USE_FUSED = True``), a
helper function a library patches in (``modeling_llama.apply_rotary_pos_emb = fused``), a value a
closure holds. torch.compile guards each such read (Dynamo sees every ``LOAD_GLOBAL``); fxflops runs
the code instead of interpreting it, so it guards what the code *can* read (:func:`code_reads`): the
names the model classes' functions load (their code objects' ``co_names``, nested code included)
that their module's globals hold, and the cells of their closures, following the functions those
name into their own globals (model code only: not torch's, not fxflops'); the same for the methods
the trace called on the plain objects the modules hold (``self.bank.read()``), the modules' hooks,
the functions the modules hold as attributes (``self.select = select``) and those the call passes (``how=fn``:
its key is its code and closure, its globals are read here; a saved program keeps those of importable
functions only). Plain values (numbers,
strings, flags, tuples of them) are compared by value, functions by identity. A module-level list,
dict or set of plain values is compared by value too (a setting changed in place, ``CONFIG["layers"]
= 2``, is another situation), unless the code fills it in place (``CACHE[key] = ...``,
``SEEN.add(...)``: a cache or a registry, compared by identity, or every new entry would be another
situation; :func:`_filled`), or it holds more than :data:`MAX_COMPARED` values. Names the
code itself assigns (``global calls; calls += 1``, ``nonlocal``) are its bookkeeping and are not
guarded (else every call would be another situation, as a recompile per call is under Dynamo). The
same bytecode tells which attributes the code only fills in place and never reads otherwise (a log,
``self.records.append(...)``): ``situation.py`` compares those by identity.
(Attributes of the model's modules and of the objects they hold, class attributes among them, are
``fxflops/situation.py``'s; the call's arguments ``fxflops/call_keys.py``'s.)
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.call_keys import SCALARS
from fxflops.capture.reads import module_at, named_modules

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

    def now(self) -> Any:
        return self.namespace.cell_contents if self.key is None else self.namespace[self.key]

    def holds(self) -> bool:
        try:
            value = self.now()
        except (KeyError, ValueError):  # deleted, or an emptied cell
            return False
        return value == self.expected if self.test == "==" else value is self.expected


def code_reads(model: torch.nn.Module, called: dict[str, set[str]], functions: list[Any] = ()) -> tuple[list[CodeRead], set[str]]:
    """The globals and closure values the code the capture ran can read (module docstring): the
    methods the trace called on the model's modules (``called``: module path -> attribute names the
    capture read there, such as ``forward``, ``get_image_features``, a loss function property), the
    modules' hooks, and the functions their code names, transitively; and those of ``functions``, the
    call's function arguments (a ``how=`` callable the forward calls). With them, the attribute
    names that code only fills in place (``self.records.append(...)``, ``self.cache[key] = v``,
    ``module.losses.extend(...)`` in a hook) and uses in no other way: a log the model keeps, which
    ``situation.py`` compares by identity, or every call that adds to it would be another situation.
    One it also reads (``torch.cat(self.mems)``, ``len(self.records)``) stays compared by value: its
    contents can change the count (a memory the next call attends over)."""
    found: dict[tuple[int, str | None], CodeRead] = {}
    filled: set[tuple[int, str | None]] = set()  # containers some function fills in place
    mutated: set[str] = set()
    used: set[str] = set()
    for fn, reads in _followed(model, called, functions):
        names, changed, other_uses = _filled(fn.__code__)
        mutated |= changed
        used |= other_uses
        for name, read in reads:
            where = (id(read.namespace), read.key)
            found.setdefault(where, read)
            if name in names:
                filled.add(where)
    code = [
        dataclasses.replace(read, expected=read.now(), test="is") if where in filled and read.test == "==" and isinstance(read.expected, _MUTABLE) else read
        for where, read in found.items()
    ]
    return code, mutated - used


def _followed(
    model: torch.nn.Module, called: dict[str, set[str]], functions: list[Any]
) -> Iterator[tuple[types.FunctionType, list[tuple[str, CodeRead]]]]:
    """The model code the capture ran, with each function's reads: the called methods, the hooks, the
    call's function arguments, and the functions their globals and closures hold, transitively (up to
    :data:`MAX_FUNCTIONS`; not library code)."""
    seen: set[int] = set()
    todo = [
        *_called_methods(model, called), *_hooks(model), *(f for value in functions for f in _functions_in(value)),
    ]
    while todo and len(seen) < MAX_FUNCTIONS:
        fn = todo.pop()
        if id(fn) in seen or _is_library(fn):
            continue
        seen.add(id(fn))
        reads = list(_reads_of(fn))
        yield fn, reads
        todo += [read.expected for _, read in reads if isinstance(read.expected, types.FunctionType)]


def _hooks(model: torch.nn.Module) -> Iterator[types.FunctionType]:
    """The functions of the hooks on the model's modules (a hook runs in the call as its module's code does)."""
    for _, module in named_modules(model):
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks):
            for hook in list(hooks.values()):
                yield from _functions_in(hook)


def _called_methods(model: torch.nn.Module, called: dict[str, set[str]]) -> Iterator[types.FunctionType]:
    """The functions behind the attributes the capture read on the model's modules, and on the
    objects they hold (keys ``"module path|held.path"``), that their classes define (methods,
    properties, static and class methods; not torch's own classes')."""
    for key, names in called.items():
        path, _, held_path = key.partition("|")
        try:
            owner = module_at(model, path)
            for part in held_path.split(".") if held_path else ():
                owner = vars(owner)[part]
        except (AttributeError, KeyError, IndexError, ValueError, TypeError):  # gone since
            continue
        for name in names:
            held = vars(owner).get(name)
            if held is not None:  # a function the module holds (``self.chosen = chosen``): its code too
                yield from _functions_in(held)
                continue
            cls = next((c for c in type(owner).__mro__ if name in vars(c)), None)
            if cls is not None and not cls.__module__.startswith(_LIBRARIES):
                yield from _functions_in(vars(cls)[name])


def _functions_in(value: Any) -> Iterator[types.FunctionType]:
    """The plain functions a class attribute or a held callable runs: a method (bound too), a static
    or class method, a property's getter, a ``functools.partial``'s function, and the functions a
    decorator wraps (``__wrapped__``)."""
    while isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
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
    return module.startswith(_LIBRARIES) or module == __name__


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """A code object and the code objects nested in it (comprehensions, lambdas)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


_WRITES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL", "STORE_DEREF", "DELETE_DEREF"})


@functools.lru_cache(maxsize=8192)  # code objects are immutable: scanned once per process
def _written(code: types.CodeType) -> frozenset[str]:
    """The globals and closure variables the code assigns (``global n; n += 1``, ``nonlocal``): the
    code's own bookkeeping (a call counter), which would otherwise make every call another situation."""
    return frozenset(i.argval for c in _codes(code) for i in dis.get_instructions(c) if i.opname in _WRITES)


_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"})
_SUBSCRIPT_WRITES = frozenset({"STORE_SUBSCR", "DELETE_SUBSCR"})
_MUTATORS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "sort", "reverse", "appendleft", "extendleft", "popleft", "__setitem__", "__delitem__", "__iadd__", "__ior__",
    "intersection_update", "difference_update", "symmetric_difference_update",
})


@functools.lru_cache(maxsize=8192)
def _filled(code: types.CodeType) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(the globals and closure variables the code changes in place, the attributes it changes in
    place, the attributes it uses otherwise). Changed in place: a name whose mutating method it looks
    up (``CACHE.setdefault``, ``SEEN.add(...)``, ``self.records.append``), and every such name it
    loads in a statement that assigns or deletes a subscript (``CACHE[key] = v``; conservatively also
    ``out[CONFIG["i"]] = v``, which only keeps that container compared by identity). An attribute
    used otherwise (``len(self.mems)``, ``torch.cat(self.mems)``, ``self.cache[key]`` read) has
    contents the count may depend on."""
    names: set[str] = set()
    changed: set[tuple[int, int]] = set()  # (code number, offset) of attribute loads that change a container
    attribute_loads: list[tuple[tuple[int, int], str]] = []
    for number, c in enumerate(_codes(code)):
        instructions = list(dis.get_instructions(c))
        attribute_loads += [((number, i.offset), i.argval) for i in instructions if i.opname == "LOAD_ATTR"]
        statement: list[dis.Instruction] = []
        for instruction in [*instructions, None]:
            line = None if instruction is None else _line_of(instruction)
            if instruction is None or (line is not None and statement and line != _line_of(statement[0])):
                if any(i.opname in _SUBSCRIPT_WRITES for i in statement):
                    names.update(i.argval for i in statement if i.opname in _LOADS)
                    changed.update((number, i.offset) for i in statement if i.opname == "LOAD_ATTR")
                statement = []
            if instruction is not None:
                statement.append(instruction)
        for loaded, looked_up in zip(instructions, instructions[1:]):
            if looked_up.opname in ("LOAD_ATTR", "LOAD_METHOD") and looked_up.argval in _MUTATORS:
                if loaded.opname in _LOADS:
                    names.add(loaded.argval)
                elif loaded.opname == "LOAD_ATTR":
                    changed.update({(number, loaded.offset), (number, looked_up.offset)})  # the method's lookup is no use
    mutated = frozenset(name for where, name in attribute_loads if where in changed)
    used = frozenset(name for where, name in attribute_loads if where not in changed)
    return frozenset(names), mutated, used


def _line_of(instruction: dis.Instruction) -> int | None:
    """The line an instruction starts (None: it continues the line before; 3.13 numbers every one)."""
    return instruction.line_number if sys.version_info >= (3, 13) else instruction.starts_line


def _reads_of(fn: types.FunctionType) -> Iterator[tuple[str, CodeRead]]:
    """The globals ``fn``'s code names (those its module holds) and its closure's cells, as reads
    with the name the code uses: plain values and functions (other objects: modules, classes, a
    logger, are not followed)."""
    namespace = fn.__globals__
    where = getattr(fn, "__module__", None) or "?"
    written = _written(fn.__code__)
    for name in {n for code in _codes(fn.__code__) for n in code.co_names} - written:
        if name in namespace:
            read = _read(f"{where}.{name} (a global {fn.__qualname__} reads)", namespace, name, namespace[name])
            if read is not None:
                yield name, read
    if hasattr(fn, "__wrapped__"):  # a decorator's wrapper: its cells hold the decorator's settings
        return
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        if name in written:
            continue
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        read = _read(f"{fn.__qualname__}'s closure variable {name}", cell, None, value)
        if read is not None:
            yield name, read


_MUTABLE = (list, dict, set)


def _read(label: str, namespace: Any, key: str | None, value: Any) -> CodeRead | None:
    if isinstance(value, type):  # a class the code builds or tests against: not state a count depends on
        return None
    if isinstance(value, (bool, type(None))):
        return CodeRead(label, namespace, key, value, "is")
    if isinstance(value, _MUTABLE):  # by value; by identity when filled in place (code_reads) or large
        return CodeRead(label, namespace, key, copied(value), "==") if plain(value, MAX_COMPARED) else CodeRead(label, namespace, key, value, "is")
    if plain(value):
        return CodeRead(label, namespace, key, copied(value), "==")
    if isinstance(value, types.FunctionType):
        return CodeRead(label, namespace, key, value, "is")
    return None


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
