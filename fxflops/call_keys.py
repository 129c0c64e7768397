"""Call keys: the identity of a call besides the sizes its symbols carry (the first part of a call's
situation, ``fxflops/situation.py``), and the fast test that a call has a key seen before.

:func:`argument_key` describes one argument as a hashable value: each tensor's type, dtype, device,
``requires_grad``, rank and layout (:func:`layout_key`) and its own Python attributes
(:func:`attributes_key`); the value of every Python scalar, string, enum, dtype or device;
containers by structure; other objects (a cache, a config passed in) by type and contents, their
tensors as inputs (without sizes: those are symbols the binder reads, so one decode program serves
every length of a key-value cache), and the plain class defaults of their classes
(:func:`class_values`); functions by code and closure; a module passed in by what it holds
(:func:`module_key`), one referred to from elsewhere by identity. :class:`CallKeys` keys a
whole call by parameter name, defaults filled in, and adds which of its input tensors are one
object (:func:`aliases`).

Building and hashing a key walks every value an argument holds (a key-value cache: every layer).
:meth:`CallKeys.check` generates, from one call, straight-line code that tests whether another call
has the same key, without building it: the tests :func:`_key` makes, each against the value it found
in that call (type identity first, so the other call's values take the same branches of
:func:`_key`). A passing test means equal keys; a failing one only that the fast path does not
apply (the key is then built and looked up as usual).
"""

from __future__ import annotations

import array
import collections
import collections.abc
import enum
import functools
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fxflops.capture.inputs import MAX_HELD_DEPTH, PLAIN_TENSORS, SEQUENCES, held_state, opaque_container, own_attributes, signature_of
from fxflops.capture.reads import attribute, library_module
from fxflops.errors import InputError

SCALARS = (  # compared by value
    bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
    torch.memory_format, torch.Size, slice, range, type, enum.Enum,
)
_EXACT_SCALARS = frozenset({bool, int, float, str, type(None), torch.dtype, torch.device})  # the common ones, by type
_HELD_INT = (int,)
_BUDGET = 4096  # values looked at inside one argument object (a larger one is refused)


def value_key(value: Any, shapes: bool = False) -> Any:
    """A hashable description of one value (see the module docstring); ``shapes``: tensors by shape
    too (tensors the trace used as constants, and those inside objects)."""
    return _key(value, shapes, None)


def argument_key(value: Any, tensors: list | None = None) -> Any:
    """:func:`value_key` of a call's argument: the tensors an argument object holds are inputs of the
    trace down to ``MAX_HELD_DEPTH`` objects deep (``capture/inputs.py``: their sizes are symbols
    the binder reads), so they are keyed without their sizes; deeper ones by shape. The tensors met
    are appended to ``tensors`` (for :func:`aliases`)."""
    return _key(value, False, [_BUDGET, 0, [] if tensors is None else tensors])


ALIASED = "(one tensor in several places)"  # the name of a call key's part saying which inputs are one tensor


def aliases(tensors: list) -> tuple:
    """The part of a call's key that says which of its input tensors (in the order the key met them)
    are one and the same object: ``()`` when all are distinct (the common case), else
    ``((ALIASED, groups),)``, each group the positions of one tensor. A trace keeps that identity
    (the fake of a tensor passed twice is one fake), and model code may branch on it (``if key is
    value``, ``nn.MultiheadAttention``'s packed projection), so ``model(x, x)`` and ``model(x, y)``
    are two situations."""
    if len(set(map(id, tensors))) == len(tensors):
        return ()
    positions: dict[int, list[int]] = {}
    for i, tensor in enumerate(tensors):
        positions.setdefault(id(tensor), []).append(i)
    return ((ALIASED, tuple(tuple(group) for group in positions.values() if len(group) > 1)),)


def _key(value: Any, shapes: bool, held: list | None) -> Any:
    """``held``: None outside argument objects' inputs, else [values left, object depth, the tensors
    met so far]."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        if held is not None:
            held[2].append(value)
        key = (kind, value.dtype, value.device, value.requires_grad, value.dim(), layout_key(value), attributes_key(value))
        return key + (tuple(value.shape),) if shapes else key
    if kind in _EXACT_SCALARS or isinstance(value, SCALARS):
        if kind is int and held is not None and held[1] and not shapes:  # an object's integer: a symbol (capture/inputs.py)
            return _HELD_INT
        if kind is float and _by_bits(value):
            return (kind, value.hex())
        if kind is slice:  # not hashable before Python 3.12
            return (kind, _slice_fields(value))
        return (kind, value)
    if opaque_container(value):
        shapes = True  # its tensors are constants of the trace: their shapes are the call's
    if kind is list or kind is tuple or isinstance(value, SEQUENCES):
        return (kind, tuple([_key(v, shapes, held) for v in value]))
    if isinstance(value, dict):
        return (kind, tuple([(k, _key(v, shapes, held)) for k, v in value.items()]))
    state = held_state(value)
    if state is None:  # functions, modules, arrays, objects without attributes
        if held is not None and isinstance(value, torch.nn.Module):
            return module_key(value)
        return _opaque_key(value, shapes)
    if held is None or shapes:  # attributes in their order: another order is another key, never a wrong one
        return (kind, "object", tuple([(name, _key(v, True, None)) for name, v in state.items()]), class_values(kind))
    held[0] -= len(state)
    if held[0] < 0:
        raise InputError(f"an argument object holds more than {_BUDGET} values: fxflops cannot tell its calls apart cheaply")
    held[1] += 1
    deep = held[1] > MAX_HELD_DEPTH  # an object the capture does not follow: its tensors are constants
    items = []
    for name, v in state.items():  # the common values inline (a cache holds many): as _key keys them
        t = type(v)
        if t is torch.Tensor and not deep:
            held[2].append(v)
            items.append((name, (t, v.dtype, v.device, v.requires_grad, v.dim(), layout_key(v), attributes_key(v))))
        elif t is int and not deep:
            items.append((name, _HELD_INT))
        elif t is bool or t is type(None):
            items.append((name, (t, v)))
        else:
            items.append((name, _key(v, deep, held)))
    held[1] -= 1
    return (kind, "object", tuple(items), class_values(kind))


def layout_key(tensor: torch.Tensor) -> Any:
    """What a trace reads of a tensor besides dtype, device and sizes: None for a plain strided
    contiguous tensor (the common case), else its layout (sparse), the conj/neg/inference bits, whether
    it is a non-leaf requiring grad, and for a non-contiguous one the order of its dims in memory
    (transposed, channels-last) and whether it has gaps (a slice): the trace fakes it in that layout,
    and model code may branch on ``is_contiguous()``. Exact strides are not part of it (a slice of a
    growing mask would be another key at every length)."""
    if tensor.layout is not torch.strided:
        return (str(tensor.layout),)
    bits = (tensor.is_conj(), tensor.is_neg(), tensor.is_inference(), tensor.requires_grad and not tensor.is_leaf)
    if tensor.is_contiguous():
        return bits if any(bits) else None
    strides = tensor.stride()
    order = tuple(sorted(range(tensor.dim()), key=lambda d: (-strides[d], d)))
    dense = tensor.numel() == 0 or sum((size - 1) * stride for size, stride in zip(tensor.shape, strides)) + 1 == tensor.numel()
    return bits + (order, dense)


def attributes_key(tensor: torch.Tensor) -> Any:
    """A tensor's own Python attributes (``x.packed = True``, set by a data pipeline, read by model
    code with ``getattr(x, "packed", False)``): None when it has none (the common case), else each
    name with its :func:`value_key` (tensors by shape). The trace's stand-in for the tensor carries
    the plain ones (``capture/symbols.fake_like``)."""
    state = own_attributes(tensor)
    return tuple([(name, _key(v, True, None)) for name, v in state.items()]) if state else None


def described_layout(key: Any) -> str:
    """A :func:`layout_key` in words, for an error naming the difference."""
    if key is None:
        return "contiguous"
    if len(key) == 1:
        return key[0]
    names = ("a conjugate view", "a negative view", "an inference tensor", "a non-leaf requiring grad")
    words = [name for name, bit in zip(names, key[:4]) if bit]
    if len(key) > 4:
        order, dense = key[4], key[5]
        words.append(f"non-contiguous, dims in memory order {order}" + ("" if dense else " and not dense (a slice, a broadcast)"))
    else:
        words.append("contiguous")
    return ", ".join(words)


_ARRAY_BYTES = 1 << 16  # a numpy array argument keyed by its contents up to this size


def _by_bits(value: float) -> bool:
    """Whether a float is keyed by its bits: 0.0 and -0.0 are equal (and hash equal), NaN is not
    equal to itself."""
    return value == 0 or value != value


def _slice_fields(value: slice) -> tuple:
    fields = (value.start, value.stop, value.step)
    if not all(v is None or type(v) is int for v in fields):
        raise InputError(f"a slice argument with bounds other than integers ({value!r}): fxflops cannot tell its calls apart")
    return fields


def _opaque_key(value: Any, shapes: bool) -> Any:
    """The key of a value that is neither a tensor, a scalar, a container nor an object with a
    ``__dict__``: what a trace can have read from it, never its address alone (CPython reuses the
    address of a freed object: a fresh ``partial(interpolate, scale_factor=4)`` or ``np.array([3])``
    made for each call may sit where last call's did).

    - ``functools.partial``: its function, arguments and keywords;
    - a function: its code, its closure's values and its defaults (a fresh lambda per call over
      another value is another key; the same code over the same values the same key);
    - a bound method: its function and the key of the object it is bound to;
    - a numpy array: dtype, shape and contents (refused above :data:`_ARRAY_BYTES`); so are the
      standard library's buffers (``bytearray``, ``array.array``, ``memoryview``);
    - a ``deque`` (its items, in order, and its ``maxlen``) and a read-only mapping
      (``types.MappingProxyType``: its items): a fresh one per call may sit at the last one's address;
    - a set or frozenset: the keys of its items, unordered (a set mutated in place, ``skip.add(2)``,
      is another key);
    - an object with ``__slots__``: its class and its slots' values; a callable object: its attributes;
    - an iterator (a generator): its type (a capture never consumes one: the code reading it is measured);
    - anything else (a module met outside a call's arguments, a builtin, an extension object): its
      identity."""
    kind = type(value)
    if isinstance(value, torch.nn.Module):  # its attributes and structure are the model state's (situation.py)
        return (kind, id(value))
    if isinstance(value, functools.partial):
        return (kind, _key(value.func, shapes, None), _key(value.args, True, None), _key(value.keywords, True, None))
    if isinstance(value, types.FunctionType):
        cells = tuple(_cell_key(c, shapes) for c in value.__closure__ or ())
        return (kind, id(value.__code__), cells, _key(value.__defaults__, True, None), _key(value.__kwdefaults__, True, None))
    if isinstance(value, types.MethodType):
        return (kind, _key(value.__func__, shapes, None), _key(value.__self__, shapes, None))
    if isinstance(value, (set, frozenset)):
        return (kind, "set", frozenset([_key(v, True, None) for v in value]))
    if isinstance(value, collections.deque):
        return (kind, "deque", value.maxlen, tuple([_key(v, True, None) for v in value]))
    if isinstance(value, types.MappingProxyType):
        return (kind, "mapping", tuple([(k, _key(v, True, None)) for k, v in value.items()]))
    if isinstance(value, (bytearray, array.array, memoryview)):
        return (kind, *_buffer_key(value))
    if _is_array(value):
        if value.nbytes > _ARRAY_BYTES:
            raise InputError(f"a numpy array argument of {value.nbytes} bytes: fxflops cannot tell its calls apart cheaply")
        return (kind, str(value.dtype), value.shape, value.tobytes())
    slots = _slot_values(value)
    if slots is not None:
        return (kind, "slots", tuple((name, _key(v, True, None)) for name, v in slots), class_values(kind))
    if isinstance(value, collections.abc.Iterator):  # its items are read by the code that takes it, never by a capture
        return (kind, "iterator")
    state = attribute(value, "__dict__")
    if callable(value) and isinstance(state, dict) and not isinstance(value, (torch.nn.Module, type)):  # a callable object
        return (kind, "object", tuple((name, _key(v, True, None)) for name, v in state.items()), class_values(kind))
    return (kind, id(value))


def module_key(module: torch.nn.Module) -> tuple:
    """The key of a module passed in a call (an adapter, a loss, a teacher model): its code runs in
    the call, but it is not the model, whose state ``situation.py`` guards. So it is keyed by what
    it holds: each of its modules by path, class and identity, with every attribute of that module
    (its ``training`` flag, flags and sizes, an instance ``forward``, parameters and buffers by
    shape, dtype and ``requires_grad``, hooks by code); a flag set or a layer replaced between two
    calls is another situation. A module an attribute refers to otherwise (a parent, another model)
    is keyed by identity. Walked at every call that passes it: a cost of the order of its modules."""
    return (type(module), id(module), tuple([
        (path, type(m), id(m), tuple([(name, _key(v, True, None)) for name, v in vars(m).items() if name != "_modules"]),
         class_values(type(m)))
        for path, m in module.named_modules()
    ]))


def class_values(kind: type) -> tuple:
    """The plain values (scalars, and tuples and frozensets of them) that the classes of model code
    in ``kind``'s method resolution order define, as the class reads them now: a default the code
    reads through an instance (``opts.deep`` with ``deep = False`` on the class, a layer's
    ``gradient_checkpointing``) changed on the class between two calls is another key. Not torch's
    or the standard library's classes. The names are found once per class (one a class gains later
    is not seen); their values are read at each call, through the class (a subclass shadowing one
    later is seen)."""
    names = _CLASS_NAMES.get(kind)
    if names is None:
        names = _CLASS_NAMES[kind] = _plain_class_attributes(kind)
    if not names:
        return ()
    return tuple([_key(getattr(kind, name, None), True, None) for name in names])


def _plain_class_attributes(kind: type) -> tuple[str, ...]:
    found: dict[str, None] = {}
    for cls in kind.__mro__:
        if library_module(getattr(cls, "__module__", None) or ""):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("__") and name not in found and _plain_value(value):
                found[name] = None
    return tuple(found)


def _plain_value(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return len(value) <= 64 and all(_plain_value(v) for v in value)
    return type(value) in _EXACT_SCALARS or (isinstance(value, SCALARS) and not isinstance(value, type))


_CLASS_NAMES: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _buffer_key(value: bytearray | array.array | memoryview) -> tuple:
    """Item format, shape and bytes of a standard library buffer (refused above :data:`_ARRAY_BYTES`)."""
    view = memoryview(value)
    if view.nbytes > _ARRAY_BYTES:
        raise InputError(f"a {type(value).__name__} argument of {view.nbytes} bytes: fxflops cannot tell its calls apart cheaply")
    return (view.format, view.shape, view.tobytes())


def _cell_key(cell: Any, shapes: bool) -> Any:
    try:
        contents = cell.cell_contents
    except ValueError:  # an empty cell
        return ()
    if isinstance(contents, types.FunctionType) and contents.__closure__ and cell in contents.__closure__:
        return (types.FunctionType, id(contents.__code__))  # a recursive closure refers to itself
    return (_key(contents, shapes, None),)


def _is_array(value: Any) -> bool:
    module = type(value).__module__
    return module == "numpy" and hasattr(value, "tobytes") and hasattr(value, "dtype")


def _slot_values(value: Any) -> list[tuple[str, Any]] | None:
    """(name, value) of an object's ``__slots__`` (its class and bases), or None without slots."""
    kind = type(value)
    names = _SLOTS.get(kind)
    if names is None:  # a class's slots are fixed when it is made: found once per class
        names = _SLOTS[kind] = tuple(n for cls in kind.__mro__ for n in _slot_names(cls) if n not in ("__dict__", "__weakref__"))
    if not names:
        return None
    return [(n, getattr(value, n, None)) for n in names]


_SLOTS: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = vars(cls).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


class CallKeys:
    """The identity of calls of ``forward`` besides their sizes (see the module docstring): each
    parameter's value by name in signature order, defaults for those not given, so that one call
    made positionally or by keyword, or omitting an argument rather than passing its default, is one
    situation. The binding plan of each layout (how many positional arguments, which keywords) is
    worked out once, as a generated function. Defaults are part of the plan: ``forward.__defaults__``
    replaced makes new plans; a mutable default (a list, a dict, an object) is keyed at every call
    (changed in place, it is another key)."""

    def __init__(self, forward: Callable[..., Any], symbolic: frozenset[str] = frozenset()) -> None:
        self._forward = forward
        self._symbolic = symbolic  # arguments whose Python ints are symbols (capture/adapters.py): keyed as ``int``
        self._planned()

    def _planned(self) -> None:
        """Plans for the forward's signature and defaults as they are now."""
        function = getattr(self._forward, "__func__", self._forward)
        self._function, self._defaults = function, _defaults_of(function)
        self._signature = signature_of(self._forward)
        self._by_layout: dict[tuple, Callable[[tuple, dict], tuple]] = {}

    def __call__(self, args: tuple, kwargs: dict) -> tuple:
        if _defaults_of(self._function) != self._defaults:  # the default values replaced
            self._planned()
        layout = (len(args), tuple(kwargs))
        key = self._by_layout.get(layout)
        if key is None:
            key = self._by_layout[layout] = self._compile(args, kwargs)
        return key(args, kwargs)

    def _compile(self, args: tuple, kwargs: dict) -> Callable[[tuple, dict], tuple]:
        """The key of calls laid out like this one: straight-line code, defaults as constants."""
        scope: dict[str, Any] = {"_vk": argument_key, "_sk": _symbolic_key, "_aliases": aliases}
        parts = []
        for i, (name, where, default) in enumerate(self._plan(args, kwargs)):
            if where is None and _mutable(default):  # keyed as it is at each call
                scope[f"_m{i}"] = default
                parts.append(f"({name!r}, _vk(_m{i}, _t))")
            elif where is None:
                scope[f"_c{i}"] = (name, value_key(default))
                parts.append(f"_c{i}")
            else:
                key = "_sk" if name in self._symbolic else "_vk"
                parts.append(f"({name!r}, {key}({'args' if type(where) is int else 'kwargs'}[{where!r}], _t))")
        source = f"def key(args, kwargs):\n    _t = []\n    return ({', '.join(parts)}{',' if parts else ''}) + _aliases(_t)\n"
        exec(compile(source, "<fxflops call key>", "exec"), scope)  # noqa: S102
        return scope["key"]

    def _plan(self, args: tuple, kwargs: dict) -> tuple:
        """(name, where its value is: a position or a keyword, or None and its default)
        per parameter (``*args`` and ``**kwargs`` as the values they collect, by position and by
        keyword); raises TypeError for a call ``forward`` does not accept."""
        bound = self._signature.bind(*args, **kwargs)
        positional = len(args)
        plan, i = [], 0
        for name, param in self._signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_POSITIONAL:
                plan += [(f"{name}[{j - i}]", j, None) for j in range(i, positional)]
                i = positional
            elif param.kind is inspect.Parameter.VAR_KEYWORD:
                named = set(self._signature.parameters)
                plan += [(k, k, None) for k in kwargs if k not in named]  # in the call's order: the code may iterate them
            elif name not in bound.arguments:
                default = param.default
                plan.append((name, None, None if default is inspect.Parameter.empty else default))
            elif param.kind is not inspect.Parameter.KEYWORD_ONLY and i < positional:
                plan.append((name, i, None))
                i += 1
            else:
                plan.append((name, name, None))
        return tuple(plan)

    def check(self, args: tuple, kwargs: dict) -> Callable[[tuple, dict], bool] | None:
        """A generated test that a call laid out like this one (the same number of positional
        arguments, the same keywords in the same order) has this call's key (see the module
        docstring); None for a call holding more values than a test is generated for."""
        tests = _Tests()
        tests.add_defaults(self._function, self._defaults)
        try:
            for i, (name, where, default) in enumerate(self._plan(args, kwargs)):
                if where is None and _mutable(default):
                    tests.scope[f"_m{i}"] = default
                    tests.add(default, f"_m{i}", False, [_BUDGET, 0, tests.tensors])
                elif where is not None:
                    source = "args" if type(where) is int else "kwargs"
                    value = args[where] if type(where) is int else kwargs[where]
                    if name in self._symbolic and type(value) is int:
                        tests.add_int(f"{source}[{where!r}]")
                    else:
                        tests.add(value, f"{source}[{where!r}]", False, [_BUDGET, 0, tests.tensors])
            tests.add_aliases()
        except _TooLarge:
            return None
        check = tests.function()
        return check if check(args, kwargs) else None

    def __getstate__(self) -> dict:
        return {"_forward": self._forward, "_symbolic": self._symbolic}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"_symbolic": frozenset(), **state})  # saved before symbolic arguments
        self._planned()


def _defaults_of(function: Any) -> tuple:
    """A function's default values, as objects (compared by identity: replacing them is a change)."""
    return (getattr(function, "__defaults__", None), getattr(function, "__kwdefaults__", None))


def _mutable(default: Any) -> bool:
    """A default that can change in place between calls: not a scalar, nor a tuple or frozenset of them."""
    if type(default) in _EXACT_SCALARS or isinstance(default, SCALARS):
        return False
    if isinstance(default, (tuple, frozenset)):
        return any(_mutable(v) for v in default)
    return not callable(default)  # a function default: keyed by its code and closure, as a constant


def _symbolic_key(value: Any, tensors: list) -> Any:
    """The key of an argument whose Python int is a symbol: ``int`` for any int, else as any value."""
    return _HELD_INT if type(value) is int else argument_key(value, tensors)


_MAX_TESTS = 4096  # lines of one generated check; a call holding more keeps the general path


class _TooLarge(Exception):
    pass


class _Tests:
    """The source of a test that a value has the key :func:`_key` gives the value it is generated
    from: the same branches (taken by exact type), each compared with what it found there."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.scope: dict[str, Any] = {}
        self.tensors: list[tuple[str, torch.Tensor]] = []  # (local, tensor) met where the key records them
        self.classes: set[type] = set()  # classes whose class_values are tested

    def add(self, value: Any, source: str, shapes: bool, held: list | None) -> None:
        """Tests for ``value``, found at ``source`` (mirrors :func:`_key` line by line)."""
        kind, x = type(value), self._local(source)
        other_type = f"type({x}) is not {self._constant(kind)}"
        if kind is torch.Tensor or isinstance(value, torch.Tensor):
            if held is not None:
                held[2].append((x, value))
            failing = [
                other_type, f"{x}.dtype is not {self._constant(value.dtype)}", self._other_device(x, value.device),
                f"{x}.requires_grad is not {value.requires_grad}", f"{x}.dim() != {value.dim()}",
            ]
            layout = layout_key(value)
            if layout is None:  # the common case, inline: strided, contiguous, no conj/neg bit, not an inference tensor
                self.scope["_strided"] = torch.strided
                failing += [f"{x}.layout is not _strided", f"not {x}.is_contiguous()", f"{x}.is_neg()", f"{x}.is_inference()"]
                if value.is_complex():  # only a complex tensor has a conj bit (its dtype is tested above)
                    failing.append(f"{x}.is_conj()")
                if value.requires_grad:  # tested above: only then can it be a non-leaf requiring grad
                    failing.append(f"not {x}.is_leaf")
            else:
                self.scope["_layout"] = layout_key
                failing.append(f"_layout({x}) != {self._constant(layout)}")
            attributes = attributes_key(value)
            if attributes is not None:
                self.scope["_attributes"] = attributes_key
                failing.append(f"_attributes({x}) != {self._constant(attributes)}")
            elif type(value) in PLAIN_TENSORS:  # the common case: no Python attributes (a subclass's are its own)
                failing.append(f"{x}.__dict__")
            if shapes:
                failing.append(f"{x}.shape != {self._constant(value.shape)}")
            self._fail_if(" or ".join(failing))
        elif kind in _EXACT_SCALARS or isinstance(value, SCALARS):
            if kind is int and held is not None and held[1] and not shapes:
                self._fail_if(other_type)
            elif kind is float and _by_bits(value):  # as _key keys it
                self._fail_if(f"{other_type} or {x}.hex() != {self._constant(value.hex())}")
            else:  # a key's tuple compares its items by identity, then ==
                c = self._constant(value)
                self._fail_if(f"{other_type} or not ({x} is {c} or {x} == {c})")
        elif kind is list or kind is tuple or isinstance(value, (list, tuple)):
            self._fail_if(f"{other_type} or len({x}) != {len(value)}")
            for i, v in enumerate(value):
                self.add(v, f"{x}[{i}]", shapes, held)
        elif isinstance(value, dict):
            self._fail_if(f"{other_type} or tuple({x}) != {self._constant(tuple(value))}")
            for k, v in value.items():
                self.add(v, f"{x}[{self._constant(k)}]", shapes, held)
        elif (state := held_state(value)) is None and held is not None and isinstance(value, torch.nn.Module):
            self.scope["_module"] = module_key
            self._fail_if(f"{other_type} or _module({x}) != {self._constant(module_key(value))}")
        elif state is None:  # tested through its key (_opaque_key)
            key = _opaque_key(value, shapes)
            self.scope["_opaque"] = _opaque_key
            self._fail_if(f"{other_type} or _opaque({x}, {shapes}) != {self._constant(key)}")
        else:
            self._fail_if(other_type)
            values = class_values(kind) if kind not in self.classes else ()  # once per class: a cache's layers share theirs
            if values:
                self.classes.add(kind)
                self.scope["_class_values"] = class_values
                self._fail_if(f"_class_values({self._constant(kind)}) != {self._constant(values)}")
            attributes = self._local(f"{x}.__dict__")
            self._fail_if(f"tuple({attributes}) != {self._constant(tuple(state))}")
            if held is None or shapes:
                for name, v in state.items():
                    self.add(v, f"{attributes}[{name!r}]", True, None)
                return
            held[0] -= len(state)
            if held[0] < 0:  # _key refuses such a call
                raise _TooLarge
            held[1] += 1
            deep = held[1] > MAX_HELD_DEPTH
            for name, v in state.items():  # _key's inline cases are _key(v, deep, held)
                self.add(v, f"{attributes}[{name!r}]", deep, held)
            held[1] -= 1

    def function(self) -> Callable[[tuple, dict], bool]:
        constants = "".join(f", {name}={name}" for name in self.scope)  # bound as defaults: fast local loads
        source = f"def check(args, kwargs{constants}):\n" + "\n".join(self.lines + ["    return True"]) + "\n"
        exec(compile(source, "<fxflops call check>", "exec"), self.scope)  # noqa: S102 - our own generated code
        return self.scope["check"]

    def _other_device(self, x: str, device: torch.device) -> str:
        """A tensor ``x`` not on ``device`` (a CPU tensor's device is always plain ``cpu``; a CUDA
        tensor's always has its index)."""
        if device.type == "cpu":
            return f"not {x}.is_cpu"
        if device.type == "cuda" and device.index is not None:
            return f"not {x}.is_cuda or {x}.get_device() != {device.index}"
        return f"{x}.device != {self._constant(device)}"

    def add_defaults(self, function: Any, defaults: tuple) -> None:
        """The test that ``function``'s default values are still the objects ``defaults``."""
        f, d = self._constant(function), self._constant(defaults)
        self._fail_if(f"getattr({f}, '__defaults__', None) is not {d}[0] or getattr({f}, '__kwdefaults__', None) is not {d}[1]")

    def add_aliases(self) -> None:
        """The test that the tensors met are one object where this call's were and distinct where
        its were distinct (:func:`aliases`)."""
        firsts: dict[int, str] = {}
        for x, tensor in self.tensors:
            first = firsts.setdefault(id(tensor), x)
            if first != x:
                self._fail_if(f"{x} is not {first}")
        if len(firsts) > 1:
            self._fail_if(f"len({{{', '.join(f'id({x})' for x in firsts.values())}}}) != {len(firsts)}")

    def add_int(self, source: str) -> None:
        """The test for an argument whose Python int is a symbol: any int."""
        self._fail_if(f"type({self._local(source)}) is not int")

    def _local(self, source: str) -> str:
        name = f"_l{len(self.lines)}"
        self.lines.append(f"    {name} = {source}")
        return name

    def _constant(self, value: Any) -> str:
        name = f"_c{len(self.scope)}"
        self.scope[name] = value
        return name

    def _fail_if(self, failing: str) -> None:
        self.lines.append(f"    if {failing}: return False")
        if len(self.lines) > _MAX_TESTS:
            raise _TooLarge
