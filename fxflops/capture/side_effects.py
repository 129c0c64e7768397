"""What the model's code writes outside its modules and the call's arguments, put back after a capture.

A trace runs more than the modules' ``forward`` methods: their hooks (forward, pre-forward and
backward hooks, the global module hooks) and every function the code calls. They run during the
capture as on every call (they must: a hook may compute, as weight norm's pre-hook does, and its
FLOPs count), and they write where they always write: a feature-extraction hook appends its output to
a list it closes over, a counter lives in a ``nonlocal`` or a global, a bound-method hook keeps
records on its object, a module-level dict or a ``functools.lru_cache`` keeps the tensors a mask or
rotary-table builder made. In a trace those are fake tensors and symbolic numbers, which the next
real call (of the wrapper or of the plain model) would get, and a hook that runs for the trace and
for the call records twice.

:func:`reach_of` finds, from the code, what that code can write to. It starts from the hooks of the
model's modules, the global module hooks, the callables the modules hold as attributes, and the
classes of the modules (every class of their MRO), and follows:

- a function: its closure cells, its defaults, and the globals its code names (its own ``co_names``
  and its nested functions'); a global that is a Python module adds the names the code looks up on
  it (``caches.table``);
- a bound method: the object it is bound to (its attributes are put back even when its class is a
  library's: the module tracker of the user's FlopCounterMode, whose global hooks run in the trace);
  a ``functools.partial``: its arguments and function;
- a class: the attributes of the names the code reached looks up (``self.rotary(...)``,
  ``cls.cache``: methods, properties, class-level caches; ``forward`` to begin with), and its
  protocol methods (``__call__``, ``__getattr__``, ...), not its constructors; all of its own
  attributes are put back (a class-level counter);
- a value found: a container (list, dict, set, deque, and those inside it) or a plain object (its
  attributes, and its class; a callable object too), whose contents are followed in turn.

Following methods by the names the code looks up, not every method of every class, keeps the reach
to the code a call can run (a Hugging Face model: its modeling file and the utilities its forward
calls, not the loading and quantisation code of ``PreTrainedModel``).
Only the model's code is followed: the packages that define the model's classes and any code outside
installed packages (a script, a test); torch, fxflops, the standard library and other installed
libraries are not (they keep none of the model's tensors). The model's own modules are left to
``capture/isolation.py`` (the twin and ``preserving_state``).

:func:`undoing_side_effects` snapshots what was found before a trace and puts it back after it, by
identity and in place (``capture/isolation.py``'s snapshots): the bindings of the globals the code
names, closure cells, class attributes, plain objects' attributes, containers' contents.
``functools.lru_cache`` functions bound as globals, class attributes or in a closure cell (the
cache a decorator's wrapper calls, as transformers' ``compile_compatible_method_lru_cache``)
cannot be put back (single entries cannot be removed): for the block, the capturing thread calls a
cache of its own of the same function instead, one per fake tensor mode (a nested trace's fakes are
its own), through ``capture/scope.py``'s thread-scoped patches; another thread and every later call
keep the user's cache, which never sees a fake. A cache the trace reached by another path and that
missed (gained an entry) meanwhile is cleared afterwards. An own cache starts empty, so the trace
runs the function where the real call may find the entry and skip its work: when a miss does work
a convention counts (the capture's ``floating_work`` test), the program holds only while the user's
cache is as empty as the trace's (``Reads.memos``, guarded by ``situation.py``), and with entries in
it the capture is refused in the calling module, whose own code is then measured on each real call
(``fxflops/islands.py``): whether it computes is known only when it runs.

Limits: a write through a path the code does not name (``getattr(obj, name)``, ``globals()[k]``, an
object a call returns), and effects outside Python objects (files, printing, a registration in a C
library) are not undone; a lazily initialised global is initialised again by the next call.
Restoring happens when the capture ends: another thread reading the same list or dict while a
capture runs may see the capture's entries meanwhile (the user's lru caches excepted), and what it
writes there meanwhile is undone with the capture's writes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import random
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch
import torch.nn.modules.module as module_module
from torch.utils._python_dispatch import TorchDispatchMode

from fxflops.capture.isolation import Restorer, attribute_values, restore_all, saved_bindings, saved_contents, saved_object
from fxflops.capture.reads import Reads, attribute
from fxflops.capture.scope import patched, patched_cell
from fxflops.errors import CaptureError

_CONTAINERS = (list, dict, set, collections.deque)
_SEQUENCES = (tuple, frozenset)
_ATOMS = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, types.ModuleType)
_CONSTRUCTORS = frozenset({"__init__", "__new__", "__init_subclass__", "__post_init__"})
_LIBRARIES = frozenset({"torch", "fxflops", *sys.stdlib_module_names})
WorkTest = Callable[[Any, tuple, dict, Any], bool]  # (func, args, kwargs, out) -> whether the op does counted work
MAX_FOUND = 20_000  # objects followed per capture
MAX_ITEMS = 1_000  # items of one container followed (all of them are restored)


def _is_lru_cache(value: Any) -> bool:
    return isinstance(value, functools._lru_cache_wrapper)


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> frozenset[str]:
    """The global and attribute names ``code`` and the functions nested in it look up."""
    nested = [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return frozenset(code.co_names).union(*map(_names, nested))


class ModelCode:
    """Which Python modules hold the model's code: those of the packages that define the classes of
    the model's modules, and any module outside installed packages (a script, a test); not torch's,
    fxflops' (but its example models), the standard library's or another installed library's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.packages = {cls.__module__.partition(".")[0] for m in model.modules() for cls in type(m).__mro__} - _LIBRARIES
        self.known: dict[str, bool] = {}

    def __call__(self, module_name: str | None) -> bool:
        if not module_name:  # code made by exec
            return True
        if module_name not in self.known:
            top = module_name.partition(".")[0]
            if module_name.startswith("fxflops.models"):
                self.known[module_name] = True
            elif top in _LIBRARIES:
                self.known[module_name] = False
            else:
                path = getattr(sys.modules.get(module_name), "__file__", None) or ""
                installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
                self.known[module_name] = top in self.packages or not installed
        return self.known[module_name]


@dataclass
class Reach:
    """What a model's code can write to outside its modules (see the module docstring)."""

    model_code: ModelCode
    namespaces: dict[int, tuple[dict, set[str]]] = field(default_factory=dict)  # globals dict -> names the code uses
    cells: list[Any] = field(default_factory=list)
    classes: list[type] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    containers: list[Any] = field(default_factory=list)
    caches: dict[tuple[int, str], tuple[Any, str]] = field(default_factory=dict)  # (module or class, name) binding an lru cache
    cached_cells: list[Any] = field(default_factory=list)  # closure cells holding an lru cache (a decorator's wrapper calls it)
    lru_caches: dict[int, Any] = field(default_factory=dict)  # every lru cache found
    generators: list[Any] = field(default_factory=list)  # random.Random and numpy generators found (capture/randomness.py)

    def saved(self) -> list[Restorer]:
        """Restorers putting all of it back as it is now."""
        restorers = [saved_bindings(namespace, tuple(used)) for namespace, used in self.namespaces.values()]
        restorers += [_saved_cell(cell) for cell in self.cells]
        restorers += [_saved_class(cls) for cls in self.classes]
        restorers += [r for obj in self.objects for r in saved_object(obj)]
        return restorers + [r for container in self.containers for r in saved_contents(container, depth=0)]


_EMPTY = object()


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return _EMPTY


def _saved_cell(cell: Any) -> Restorer:
    """A restorer putting back what a closure cell holds (``nonlocal count; count += 1``)."""
    before = _contents(cell)

    def restore() -> None:
        if _contents(cell) is before:
            return
        if before is _EMPTY:
            del cell.cell_contents
        else:
            cell.cell_contents = before

    return restore


def _saved_class(cls: type) -> Restorer:
    """A restorer putting back a class's own attributes by identity (not its dunder entries)."""
    before = {name: value for name, value in vars(cls).items() if not _dunder(name)}

    def restore() -> None:
        now = vars(cls)
        for name in [n for n in now if not _dunder(n) and n not in before]:
            delattr(cls, name)
        for name, value in before.items():
            if now.get(name) is not value:
                setattr(cls, name, value)

    return restore


def _dunder(name: str) -> bool:
    return name[:2] == "__" and name[-2:] == "__"


def _parts(attribute: Any) -> list[Any]:
    """The functions and values a class attribute holds (a property's accessors, a static method's function)."""
    if isinstance(attribute, (staticmethod, classmethod)):
        return [attribute.__func__]
    if isinstance(attribute, property):
        return [f for f in (attribute.fget, attribute.fset, attribute.fdel) if f is not None]
    if isinstance(attribute, functools.cached_property):
        return [attribute.func]
    return [attribute]


class _Walk:
    """Follows the model's code to what it can write to, into a :class:`Reach` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_code = ModelCode(model)
        self.reach = Reach(self.model_code)
        self.seen: set[int] = {id(m) for m in model.modules()}  # the modules: capture/isolation.py's
        self.todo: list[Any] = []
        self.names: set[str] = {"forward"}  # the attribute names the code reached looks up (and torch calls)
        self.classes: list[type] = []

    def run(self, roots: list[Any]) -> Reach:
        self.todo.extend(roots)
        while self.todo and len(self.seen) < MAX_FOUND:
            self.visit(self.todo.pop())
        return self.reach

    def visit(self, value: Any) -> None:
        if isinstance(value, _ATOMS) or id(value) in self.seen:
            return
        self.seen.add(id(value))
        if isinstance(value, type):
            self.cls(value)
        elif isinstance(value, functools.partial):
            self.todo.extend((*value.args, *value.keywords.values(), value.func))
        elif isinstance(value, types.MethodType):
            self.bound_to(value.__self__)
            self.todo.extend((value.__self__, value.__func__))
        elif _is_lru_cache(value):
            self.reach.lru_caches[id(value)] = value
            self.todo.append(value.__wrapped__)
        elif isinstance(value, types.FunctionType):
            self.function(value)
        elif isinstance(value, _CONTAINERS):
            self.reach.containers.append(value)
            self.todo.extend(islice(value.values() if isinstance(value, dict) else value, MAX_ITEMS))
        elif isinstance(value, _SEQUENCES):
            self.todo.extend(islice(value, MAX_ITEMS))
        elif isinstance(value, random.Random) or numpy_generator(value):
            self.reach.generators.append(value)
        elif self.model_code(type(value).__module__):  # a plain object, a callable one too
            self.reach.objects.append(value)
            self.todo.extend((*attribute_values(value), type(value)))

    def bound_to(self, owner: Any) -> None:
        """The object a method found is bound to: its attributes are put back also when its class is
        a library's, whose code is not followed (the module tracker of the user's FlopCounterMode,
        whose global module hooks run in the trace)."""
        library = not isinstance(owner, (type, types.ModuleType)) and not self.model_code(type(owner).__module__)
        if library and attribute(owner, "__dict__") is not None and id(owner) not in self.seen:
            self.seen.add(id(owner))
            self.reach.objects.append(owner)

    def function(self, fn: types.FunctionType) -> None:
        if not self.model_code(fn.__globals__.get("__name__")):
            return
        for cell in fn.__closure__ or ():
            self.reach.cells.append(cell)
            self.todo.append(_contents(cell))
            if _is_lru_cache(_contents(cell)):
                self.reach.cached_cells.append(cell)
        self.todo.extend((*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()))
        names = _names(fn.__code__)
        self.look_up(names)
        self.globals(fn.__globals__, names)

    def look_up(self, names: frozenset[str]) -> None:
        """The code reached looks up ``names``: the attributes of those names of the classes reached."""
        new = names - self.names
        if new:
            self.names |= new
            for cls in self.classes:
                self.attributes(cls, new)

    def globals(self, namespace: dict, names: frozenset[str], through_modules: bool = True) -> None:
        """The globals of ``namespace`` among ``names``, and the names looked up on a Python module
        among them (``utils.table``: one level)."""
        used = names & namespace.keys()
        if not used:
            return
        self.reach.namespaces.setdefault(id(namespace), (namespace, set()))[1].update(used)
        owner = sys.modules.get(namespace.get("__name__", ""))
        for name in used:
            value = namespace[name]
            if isinstance(value, types.ModuleType):
                if through_modules and self.model_code(value.__name__):
                    self.globals(vars(value), names, through_modules=False)
                continue
            if _is_lru_cache(value) and owner is not None and vars(owner) is namespace:
                self.reach.caches[(id(owner), name)] = (owner, name)
            self.todo.append(value)

    def cls(self, cls: type) -> None:
        """A class the code uses: its attributes that the code looks up, and its protocol methods
        (``__call__``, ``__getattr__``, ...; not its constructors: they write to a new object)."""
        if cls is object or not self.model_code(cls.__module__):
            return
        self.reach.classes.append(cls)
        self.classes.append(cls)
        implicit = {name for name in vars(cls) if _dunder(name) and name not in _CONSTRUCTORS}
        self.attributes(cls, self.names | implicit)

    def attributes(self, cls: type, names: set[str]) -> None:
        for name in names & vars(cls).keys():
            value = vars(cls)[name]
            if _is_lru_cache(value) or isinstance(value, staticmethod) and _is_lru_cache(value.__func__):
                self.reach.caches[(id(cls), name)] = (cls, name)
            self.todo.extend(_parts(value))


def numpy_generator(value: Any) -> bool:
    """Whether ``value`` is a numpy generator object (``Generator``, ``RandomState``): its methods
    are C code that cannot be patched, so its draws are found by its state."""
    numpy_random = sys.modules.get("numpy.random")
    return numpy_random is not None and issubclass(type(value), (numpy_random.Generator, numpy_random.RandomState))


def reach_of(model: torch.nn.Module) -> Reach:
    """What ``model``'s code can write to outside its modules (see the module docstring)."""
    roots: list[Any] = []
    registries = [value for name, value in vars(module_module).items() if name.startswith("_global_") and name.endswith("hooks")]
    for m in model.modules():
        for name, value in vars(m).items():
            if isinstance(value, dict) and name.endswith("hooks"):
                registries.append(value)
            elif callable(value) and not isinstance(value, torch.nn.Module):
                roots.append(value)
        roots.extend(type(m).__mro__)
    roots.extend(hook for registry in registries for hook in list(registry.values()) if callable(hook))
    return _Walk(model).run(roots[::-1])


def _per_fake_mode(cache: Any, reads: Reads, floating_work: WorkTest | None) -> Callable[..., Any]:
    """A function calling, in each fake tensor mode, a fresh lru cache of ``cache``'s function; a
    lookup that runs the function (a miss) and does floating-point work in it is :func:`_computed`."""
    parameters = cache.cache_parameters()
    own: dict[Any, Any] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if mode not in own:
            own[mode] = functools.lru_cache(**parameters)(cache.__wrapped__)
        misses = own[mode].cache_info().misses
        with _FloatingWork(floating_work) as work:
            out = own[mode](*args, **kwargs)
        if work.found is not None and own[mode].cache_info().misses != misses:
            _computed(cache, work.found, reads)
        return out

    return call


class _FloatingWork(TorchDispatchMode):
    """Notes the first op of the block that does floating-point work (``found``; by the test the
    capture was given, else any op)."""

    def __init__(self, floating_work: WorkTest | None) -> None:
        super().__init__()
        self.found: Any = None
        self.floating_work = floating_work

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is None and (self.floating_work is None or self.floating_work(func, args, kwargs, out)):
            self.found = func
        return out


def _computed(cache: Any, op: Any, reads: Reads) -> None:
    """The trace ran ``cache``'s function on a miss of its own (empty) cache, and that work is
    counted. The real call computes it only if the user's cache lacks the entry, which cannot be
    asked without filling it: with the user's cache empty the trace is what the call does (the
    program holds while it stays empty, ``reads.memos``); with entries in it, whether the call
    computes is known only when it runs, so the calling module's own code is measured
    (``fxflops/islands.py``), in that state."""
    empty = cache.cache_info().currsize == 0
    reads.memos[id(cache)] = (cache, empty)
    if not empty:
        name = getattr(cache, "__qualname__", repr(cache))
        raise CaptureError(
            f"{name} (a functools.lru_cache the model's code calls) does floating-point work ({op}) when it "
            "misses, and its cache holds entries: whether this call computes it again is known only when it runs"
        )


@contextlib.contextmanager
def _own_caches(reach: Reach, reads: Reads, floating_work: WorkTest | None) -> Iterator[None]:
    """For the block, the capturing thread calls caches of its own instead of the lru caches the
    model's code names; any of those that missed meanwhile is cleared afterwards, also after a
    failed trace (what it left there is a fake)."""
    misses = {key: cache.cache_info().misses for key, cache in reach.lru_caches.items()}
    try:
        with contextlib.ExitStack() as stack:
            for owner, name in reach.caches.values():
                raw = vars(owner).get(name)
                cache = raw.__func__ if isinstance(raw, staticmethod) else raw
                if _is_lru_cache(cache):  # unless rebound since the reach was found
                    stack.enter_context(patched(owner, name, _per_fake_mode(cache, reads, floating_work)))
            for cell in reach.cached_cells:
                if _is_lru_cache(_contents(cell)):
                    stack.enter_context(patched_cell(cell, _per_fake_mode(_contents(cell), reads, floating_work)))
            yield
            if any(not empty for _, empty in reads.memos.values()):  # the refusal was caught by the model's own code
                raise CaptureError(
                    "a functools.lru_cache the model's code calls does floating-point work when it misses and its cache "
                    "holds entries (the refusal raised there was caught by the model's code): measured", module="",
                )
    finally:
        for key, cache in reach.lru_caches.items():
            if cache.cache_info().misses != misses[key]:
                cache.cache_clear()


@contextlib.contextmanager
def undoing_side_effects(reach: Reach, reads: Reads, floating_work: WorkTest | None = None) -> Iterator[None]:
    """For the block (one trace of the model whose :func:`reach_of` is ``reach``): what its code
    writes outside its modules is put back afterwards, and its lru caches are its own (see the
    module docstring)."""
    saved = reach.saved()
    try:
        with _own_caches(reach, reads, floating_work):
            yield
    finally:
        restore_all(saved)
