"""The generated fast test of a call's key (``CallKeys.check``) agrees with the key itself.

A call in a situation seen before is recognised by a test generated from an earlier call of that
situation instead of building and hashing its key. The test must pass exactly when the key would be
equal: here every value kind the key describes is changed in one place at a time (a tensor's dtype,
``requires_grad``, rank or size, a scalar's value or type, a container's length or order, an
object's attributes, a deep object's tensor size, a function's identity), and the fast test is
compared with the equality of the keys built by ``CallKeys``.
"""

from __future__ import annotations

import copy
import enum

import pytest
import torch

from fxflops.call_keys import CallKeys
from fxflops.capture.inputs import MAX_HELD_DEPTH


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Layer:
    def __init__(self, length: int) -> None:
        self.keys = torch.zeros(2, 3, length, 4)
        self.values = torch.zeros(2, 3, length, 4)
        self.offset = length
        self.is_initialized = True
        self.device = torch.device("cpu")


class Cache:
    def __init__(self, layers: int, length: int) -> None:
        self.layers = [Layer(length) for _ in range(layers)]
        self.layer_class = Layer
        self.offloading = False


class Node:
    def __init__(self, depth: int) -> None:
        self.tensor = torch.zeros(depth + 1, 2)
        self.count = depth
        self.child = Node(depth - 1) if depth else None


def forward(input_ids, cache=None, mask=None, *extra, scale=1.0, mode="a", **options):  # noqa: ANN001, ANN002, ANN003
    return input_ids


def _base() -> tuple[tuple, dict]:
    args = (torch.zeros(2, 5, dtype=torch.long), Cache(2, 7), torch.ones(2, 5, dtype=torch.bool))
    kwargs = {
        "scale": 0.5,
        "mode": "b",
        "color": Color.RED,
        "dtype": torch.float16,
        "size": torch.Size([3, 4]),
        "window": slice(0, 8, None),
        "pair": (1, [torch.zeros(3), None]),
        "table": {"a": torch.zeros(2, requires_grad=True), "b": 3},
        "deep": Node(MAX_HELD_DEPTH + 2),
        "fn": torch.relu,
        "module": _MODULE,
        "flag": True,
        "none": None,
        "zero": 0.0,
        "nan": float("nan"),
        "twin": torch.zeros(3),  # made one object with pair's tensor below
    }
    return args, kwargs


_MODULE = torch.nn.Linear(2, 2)


def _changes() -> dict[str, object]:
    """One change each (applied to a fresh base call): name -> function(args, kwargs) -> (args, kwargs)."""

    def kw(name, value):  # noqa: ANN001, ANN202
        def change(args, kwargs):  # noqa: ANN001, ANN202
            return args, {**kwargs, name: value}
        return change

    def layer(attribute, value):  # noqa: ANN001, ANN202
        def change(args, kwargs):  # noqa: ANN001, ANN202
            setattr(args[1].layers[1], attribute, value)
            return args, kwargs
        return change

    def node(level, attribute, value):  # noqa: ANN001, ANN202
        def change(args, kwargs):  # noqa: ANN001, ANN202
            n = kwargs["deep"]
            for _ in range(level):
                n = n.child
            setattr(n, attribute, value)
            return args, kwargs
        return change

    def aliased(args, kwargs):  # noqa: ANN001, ANN202
        return args, {**kwargs, "twin": kwargs["pair"][1][0]}

    def layer_aliased(args, kwargs):  # noqa: ANN001, ANN202
        args[1].layers[0].values = args[1].layers[0].keys
        return args, kwargs

    def arg(i, value):  # noqa: ANN001, ANN202
        def change(args, kwargs):  # noqa: ANN001, ANN202
            return args[:i] + (value,) + args[i + 1 :], kwargs
        return change

    return {
        "nothing": lambda args, kwargs: (args, kwargs),
        "input size": arg(0, torch.zeros(3, 9, dtype=torch.long)),
        "input dtype": arg(0, torch.zeros(2, 5, dtype=torch.int32)),
        "input rank": arg(0, torch.zeros(10, dtype=torch.long)),
        "input requires grad": arg(0, torch.zeros(2, 5, requires_grad=True)),
        "input subclass": arg(0, torch.nn.Parameter(torch.zeros(2, 5), requires_grad=False)),
        "input on meta": arg(0, torch.zeros(2, 5, dtype=torch.long, device="meta")),
        "mask None": arg(2, None),
        "cache length": arg(1, Cache(2, 11)),
        "cache layers": arg(1, Cache(3, 7)),
        "layer tensor dtype": layer("keys", torch.zeros(2, 3, 7, 4, dtype=torch.float64)),
        "layer tensor rank": layer("values", torch.zeros(2, 3, 7)),
        "layer tensor None": layer("keys", None),
        "layer int value": layer("offset", 99),
        "layer int to bool": layer("offset", True),
        "layer flag": layer("is_initialized", False),
        "layer device": layer("device", torch.device("meta")),
        "layer new attribute": layer("extra", 1),
        "cache attribute order": lambda args, kwargs: (_reordered(args), kwargs),
        "scale value": kw("scale", 0.25),
        "scale int equal": kw("scale", 0),
        "mode": kw("mode", "c"),
        "color": kw("color", Color.BLUE),
        "dtype": kw("dtype", torch.bfloat16),
        "size": kw("size", torch.Size([3, 5])),
        "window": kw("window", slice(0, 9, None)),
        "pair length": kw("pair", (1, [torch.zeros(3)])),
        "pair tensor to None": kw("pair", (1, [None, None])),
        "pair tensor size": kw("pair", (1, [torch.zeros(4), None])),
        "pair list to tuple": kw("pair", (1, (torch.zeros(3), None))),
        "table order": kw("table", {"b": 3, "a": torch.zeros(2, requires_grad=True)}),
        "table value": kw("table", {"a": torch.zeros(2, requires_grad=True), "b": 4}),
        "table grad": kw("table", {"a": torch.zeros(2), "b": 3}),
        "shallow node tensor size": node(1, "tensor", torch.zeros(9, 2)),
        "shallow node int": node(1, "count", 50),
        "deep node tensor size": node(MAX_HELD_DEPTH + 1, "tensor", torch.zeros(9, 2)),
        "deep node int": node(MAX_HELD_DEPTH + 1, "count", 50),
        "fn": kw("fn", torch.tanh),
        "module": kw("module", torch.nn.Linear(2, 2)),
        "flag": kw("flag", False),
        "none to zero": kw("none", 0),
        "zero's sign": kw("zero", -0.0),  # equal to 0.0 (and hashes equal), but math.copysign tells them apart
        "nan another object": kw("nan", float("nan")),  # NaN != NaN: still the same value
        "nan to a number": kw("nan", 1.0),
        "option added": kw("verbose", True),
        "one tensor in two arguments": aliased,
        "one tensor in two attributes of an argument object": layer_aliased,
    }


def _reordered(args: tuple) -> tuple:
    cache = args[1]
    state = dict(vars(cache))
    vars(cache).clear()
    for name in reversed(list(state)):
        setattr(cache, name, state[name])
    return args


@pytest.mark.parametrize("change", list(_changes()))
def test_the_fast_test_passes_exactly_when_the_key_is_equal(change):
    keys = CallKeys(forward)
    base_args, base_kwargs = _base()
    check = keys.check(base_args, base_kwargs)
    assert check is not None
    args, kwargs = _changes()[change](*copy.deepcopy((base_args, base_kwargs)))
    kwargs = {**kwargs, "module": kwargs["module"] if change == "module" else _MODULE}
    same_layout = (len(args), tuple(kwargs)) == (len(base_args), tuple(base_kwargs))
    if not same_layout:  # another layout is another test (the caller looks tests up by layout)
        assert keys(args, kwargs) != keys(base_args, base_kwargs)
        return
    assert check(args, kwargs) == (keys(args, kwargs) == keys(base_args, base_kwargs)), change


def test_the_expected_changes_are_differences_and_sizes_are_not():
    """The comparison above is not vacuous: sizes the binder reads keep the key, the rest change it."""
    keys = CallKeys(forward)
    base_args, base_kwargs = _base()
    check = keys.check(base_args, base_kwargs)
    same = {
        "nothing", "input size", "cache length", "pair tensor size", "shallow node tensor size", "shallow node int", "layer int value",
        "nan another object",
    }
    for name, change in _changes().items():
        args, kwargs = change(*copy.deepcopy((base_args, base_kwargs)))
        kwargs = {**kwargs, "module": kwargs["module"] if name == "module" else _MODULE}
        if (len(args), tuple(kwargs)) != (len(base_args), tuple(base_kwargs)):
            continue
        assert check(args, kwargs) == (name in same), name


def test_a_call_holding_too_many_values_keeps_the_general_path():
    keys = CallKeys(forward)
    args = (torch.zeros(2, 5), [torch.zeros(1) for _ in range(5000)])
    assert keys.check(args, {}) is None
    assert keys(args, {}) == keys((torch.zeros(3, 5), [torch.zeros(2) for _ in range(5000)]), {})


def test_keys_are_hashable_with_every_value_kind():
    """A situation is a dictionary key: a slice (unhashable before Python 3.12) must not make a
    call's key unusable, and keys equal as values hash equal."""
    keys = CallKeys(forward)
    base_args, base_kwargs = _base()
    again_args, again_kwargs = copy.deepcopy((base_args, base_kwargs))
    again_kwargs = {**again_kwargs, "module": _MODULE, "nan": float("nan")}
    assert hash(keys(base_args, base_kwargs)) == hash(keys(again_args, again_kwargs))
    assert {keys(base_args, base_kwargs): 1}[keys(again_args, again_kwargs)] == 1


def test_which_tensors_are_one_object_is_part_of_the_key_in_both_directions():
    """A call passing one tensor in two places and one passing two tensors are two situations
    whichever was seen first; the same sharing with other tensor objects is the same situation."""
    keys = CallKeys(forward)

    def call(shared: bool) -> tuple[tuple, dict]:
        args, kwargs = _base()
        kwargs = {**kwargs, "module": _MODULE}
        if shared:
            kwargs["twin"] = kwargs["pair"][1][0]
        return args, kwargs

    for first in (True, False):
        check = keys.check(*call(first))
        for now in (True, False):
            args, kwargs = call(now)
            assert (keys(*call(first)) == keys(args, kwargs)) == (first == now)
            assert check(args, kwargs) == (first == now), (first, now)
    three = lambda t, u, v: ((t, u, v), {})  # noqa: E731
    x, y = torch.zeros(2), torch.zeros(2)
    patterns = {"x x y": three(x, x, y), "x y x": three(x, y, x), "x y y": three(x, y, y), "x x x": three(x, x, x), "x y z": three(x, y, torch.zeros(2))}
    for name, (args, kwargs) in patterns.items():
        check = keys.check(args, kwargs)
        for other, (args2, kwargs2) in patterns.items():
            assert (keys(args, kwargs) == keys(args2, kwargs2)) == (name == other), (name, other)
            assert check(args2, kwargs2) == (name == other), (name, other)


class _Adapter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.twice = False
        object.__setattr__(self, "parent", _MODULE)  # another module it refers to, not a child: by identity


def test_a_module_passed_in_a_call_is_keyed_by_what_it_holds():
    """A module given as an argument runs in the call but is not the model: a flag set on it, a
    layer replaced, its mode or a parameter's size or ``requires_grad`` changed is another key (and
    the fast test fails); the module untouched, or a module it refers to changed, is the same key."""

    def changes() -> dict[str, object]:
        def set_(name, value):  # noqa: ANN001, ANN202
            return lambda m: setattr(m, name, value)
        return {
            "nothing": lambda m: None,
            "a flag": set_("twice", True),
            "a layer replaced": set_("fc", torch.nn.Linear(2, 2)),
            "eval mode": lambda m: m.eval(),
            "a child's eval mode": lambda m: m.fc.eval(),
            "a frozen parameter": lambda m: m.fc.weight.requires_grad_(False),
            "a parameter resized": lambda m: setattr(m.fc, "weight", torch.nn.Parameter(torch.zeros(3, 2))),
            "an instance forward": set_("forward", lambda x: x),
            "a forward hook": lambda m: m.register_forward_hook(lambda *a: None),
            "the module it refers to": lambda m: setattr(_MODULE, "extra_flag", True),
        }

    keys = CallKeys(forward)
    unchanged = {"nothing", "the module it refers to"}
    for name, change in changes().items():
        adapter = _Adapter()
        args, kwargs = (torch.zeros(2, 5),), {"module": adapter}
        before, check = keys(args, kwargs), keys.check(args, kwargs)
        change(adapter)
        assert (keys(args, kwargs) == before) == (name in unchanged), name
        assert check(args, kwargs) == (name in unchanged), name
    vars(_MODULE).pop("extra_flag", None)


def test_standard_library_containers_are_keyed_by_contents():
    """A deque, a bytearray, an ``array.array`` and a read-only mapping passed in a call: changed in
    place, another key (and the fast test fails); a fresh one with the same contents, the same key
    (never the address: a fresh one per call may sit where the last one did)."""
    import array
    import collections
    import types

    made = {
        "deque": lambda: collections.deque([1, 2], maxlen=4),
        "bytearray": lambda: bytearray(b"ab"),
        "array": lambda: array.array("i", [1, 2]),
        "mapping": lambda: types.MappingProxyType({"a": 1}),
    }
    changed = {
        "deque": lambda v: v.append(3),
        "bytearray": lambda v: v.__setitem__(0, 0),
        "array": lambda v: v.__setitem__(0, 7),
    }
    keys = CallKeys(forward)
    for name, make in made.items():
        value = make()
        args, kwargs = (torch.zeros(2, 5),), {"plan": value}
        before, check = keys(args, kwargs), keys.check(args, kwargs)
        fresh = {"plan": make()}
        assert keys(args, fresh) == before and check(args, fresh), name
        if name in changed:
            changed[name](value)
        else:
            value = types.MappingProxyType({"a": 2})
        assert keys(args, {"plan": value}) != before and not check(args, {"plan": value}), name
