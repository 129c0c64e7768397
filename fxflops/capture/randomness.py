"""A capture neither consumes the user's Python or numpy random numbers nor keeps one draw.

Model code may draw from Python's ``random`` or numpy's global generator in its forward: LayerDrop
(``if random.random() < p:`` skip a layer), a loop count from ``random.randint``. A trace runs that
code once more than the uninstrumented run: it would consume draws from the user's stream (every
later draw differs from the uninstrumented run's), and its program would keep the branch of its one
draw for every later call, a silently wrong count. (torch's generators are not concerned: a fake
trace's ``torch.rand`` draws nothing, and a branch on its value is data-dependent.)

:func:`refusing_random_draws` wraps one trace: the states of Python's and numpy's global generators
are saved before it and put back after it, and a trace that drew fails with :class:`RandomDraw`, a
:class:`CaptureError` at the innermost module whose own code drew. fxflops then counts the calls of
that situation by measuring that module's own code on the real call, which draws exactly as the
uninstrumented model does, its children traced as usual (``fxflops/islands.py``).

Draws are recorded in the capturing thread only (``capture/scope.py``'s thread-scoped patches)
through the global generators' functions (``random.random``, ``np.random.rand``, ...), the same
functions bound to names of the model's code (``from random import random``; its globals are found
by ``capture/side_effects.py``), and the two methods every other method of a ``random.Random`` draws
with (``random`` and ``getrandbits``), patched on Python's global generator and on the generators the
model holds (as its modules' attributes, in their containers, in the objects they hold, or where its
code reaches them; whose states are put back too). numpy's ``Generator`` and ``RandomState`` objects
(``np.random.default_rng()``), whose C methods cannot be patched, are found the same way and
compared by state: one that changed refuses the trace at the root module, and is put back. Only the model's code's draws refuse a trace
(``side_effects.ModelCode``): a library drawing from its own generator (sympy, while torch reasons
about sizes) is not seen, and one drawing from a global generator is put back all the same. A global
state that changed with no draw seen (a path not patched) refuses the trace at the root module, whose
measured calls then capture each child, and a child that draws is refused in turn.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fxflops.capture.reads import attribute, held_objects
from fxflops.capture.scope import patched
from fxflops.capture.shape_env import format_location, is_library_file
from fxflops.capture.side_effects import Reach, numpy_generator
from fxflops.errors import CaptureError

_DRAWING_METHODS = ("random", "getrandbits")  # what every other method of a random.Random draws with
_READERS = frozenset({"getstate", "get_state", "get_bit_generator"})  # functions that leave the state as it is


class RandomDraw(CaptureError):
    """The traced code drew Python or numpy random numbers (see the module docstring)."""


class _Draws:
    """The draws the model's code made in one trace: the first one's module and line, and each
    generator's state before its first draw."""

    def __init__(self, model: torch.nn.Module, model_code: Callable[[str | None], bool]) -> None:
        self.paths = {id(vars(m)): path for path, m in model.named_modules(remove_duplicate=False)}
        self.model_code = model_code
        self.files = _generator_files()
        self.first: tuple[str, str, str] | None = None  # (what, module path, location) of the model's first draw
        self.by_library = False  # a library's code drew (from a global generator)
        self.states: dict[int, tuple[Any, Any]] = {}  # id(generator) -> (generator, state before)

    def note(self, generator: Any, what: str) -> None:
        """A draw from ``generator`` through ``what``: recorded when the model's code made it (not a
        library's, such as sympy's own generator while torch reasons about sizes)."""
        frame = _caller(sys._getframe(1), self.files)
        if frame is None or not self.model_code(frame.f_globals.get("__name__")):
            self.by_library = True
            return
        if id(generator) not in self.states:
            self.states[id(generator)] = (generator, _state(generator))
        if self.first is None:
            self.first = (what, self._innermost_module(frame), _model_line(frame))

    def _innermost_module(self, frame: types.FrameType | None) -> str:
        """The path of the innermost module whose call ``frame`` is in (the root when none)."""
        while frame is not None:
            if "self" in frame.f_code.co_varnames:
                owner = frame.f_locals.get("self")
                if isinstance(owner, torch.nn.Module):
                    path = self.paths.get(id(object.__getattribute__(owner, "__dict__")))
                    if path is not None:
                        return path
            frame = frame.f_back
        return ""

    def restore(self) -> None:
        for generator, state in self.states.values():
            _set_state(generator, state)


def _generator_files() -> tuple[str, ...]:
    """The files of the generators' own code: ``random.py`` and numpy's package."""
    numpy = sys.modules.get("numpy")
    return (random.__file__,) + ((os.path.dirname(numpy.__file__) + os.sep,) if getattr(numpy, "__file__", None) else ())


_RECORDING = frozenset({__name__, patched.__module__})  # the recorders' frames


def _caller(frame: types.FrameType | None, files: tuple[str, ...]) -> types.FrameType | None:
    """The innermost frame outside the recorders and the generators' own code (``files``)."""
    while frame is not None and (frame.f_globals.get("__name__") in _RECORDING or frame.f_code.co_filename.startswith(files)):
        frame = frame.f_back
    return frame


def _model_line(frame: types.FrameType) -> str:
    """The innermost line of the model's code on the stack from ``frame`` (not torch's or fxflops')."""
    frames = [f for f in traceback.extract_stack(frame) if not is_library_file(f.filename)]
    return format_location(frames[-1]) if frames else "an unknown line"


def _state(generator: Any) -> Any:
    if isinstance(generator, random.Random):
        return generator.getstate()
    if hasattr(generator, "bit_generator"):  # numpy's Generator (``np.random.default_rng()``)
        return generator.bit_generator.state
    return generator.get_state()  # numpy's RandomState


def _set_state(generator: Any, state: Any) -> None:
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def _same_state(a: Any, b: Any) -> bool:
    return _comparable(a) == _comparable(b)


def _comparable(state: Any) -> Any:
    """A generator's state with its arrays as bytes (numpy's keys): comparable with ``==``."""
    if isinstance(state, dict):
        return tuple(sorted((k, _comparable(v)) for k, v in state.items()))
    if isinstance(state, (tuple, list)):
        return tuple(map(_comparable, state))
    if hasattr(state, "tobytes") and hasattr(state, "dtype"):
        return ("array", str(state.dtype), getattr(state, "shape", ()), state.tobytes())
    return state


def _global_generators() -> dict[int, tuple[Any, Any]]:
    """Python's global generator and numpy's (when numpy is loaded), each with the module whose
    functions are its bound methods."""
    numpy_random = sys.modules.get("numpy.random")
    legacy = getattr(getattr(numpy_random, "mtrand", None), "_rand", None)
    found = {id(random._inst): (random._inst, random)}
    return found | ({id(legacy): (legacy, numpy_random)} if legacy is not None else {})


def _drawing_names(generators: dict[int, tuple[Any, Any]], namespaces: list[dict]) -> list[tuple[Any, str, Any]]:
    """(owner, name, generator) of every name bound to a drawing function of a global generator:
    the generators' module functions (``random.random``), and such functions the model's code bound
    to its own names (``from random import random``)."""
    found = []
    for namespace in [vars(module) for _, module in generators.values()] + namespaces:
        owner = sys.modules.get(namespace.get("__name__", ""))
        if owner is None or vars(owner) is not namespace:
            continue
        for name, value in list(namespace.items()):
            generator = attribute(value, "__self__")
            if id(generator) in generators and generators[id(generator)][0] is generator and callable(value) and name not in _READERS:
                found.append((owner, name, generator))
    return found


def _recording(draws: _Draws, generator: Any, what: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def draw(*args: Any, **kwargs: Any) -> Any:
        draws.note(generator, what)
        return original(*args, **kwargs)

    return draw


def _held_generators(model: torch.nn.Module, reach: Reach) -> list[Any]:
    """Python's global generator and the generators the model holds (``random.Random``, numpy's
    ``Generator`` and ``RandomState``): as attributes of its modules or of the objects they hold,
    in their containers, or where its code reaches them."""
    found = {id(random._inst): random._inst} | {id(g): g for g in reach.generators}
    holders = [*model.modules(), *held_objects(model).values()]
    for holder in holders:
        for value in list(attribute(holder, "__dict__", {}).values()):
            kind = type(value)  # by type: ``isinstance`` reads ``__class__`` through an object's own lookup
            items = value.values() if issubclass(kind, dict) else value if issubclass(kind, (list, tuple)) else (value,)
            found.update({id(item): item for item in items if issubclass(type(item), random.Random) or numpy_generator(item)})
    return list(found.values())


@contextlib.contextmanager
def refusing_random_draws(model: torch.nn.Module, reach: Reach) -> Iterator[None]:
    """For the block (one trace of ``model``, whose code reaches ``reach``: ``capture/side_effects.py``):
    Python's and numpy's random states are put back afterwards, and :class:`RandomDraw` is raised
    when the model's code drew (see the module docstring)."""
    generators = _global_generators()
    held = _held_generators(model, reach)
    unpatchable = [g for g in held if numpy_generator(g) and id(g) not in generators]  # seen by their states
    before = [(g, _state(g)) for g, _ in generators.values()] + [(g, _state(g)) for g in unpatchable]
    draws = _Draws(model, reach.model_code)
    namespaces = [namespace for namespace, _ in reach.namespaces.values()]
    with contextlib.ExitStack() as stack:
        for owner, name, generator in _drawing_names(generators, namespaces):
            what = f"{getattr(owner, '__name__', owner)}.{name}"
            stack.enter_context(patched(owner, name, _recording(draws, generator, what, getattr(owner, name))))
        for generator in held:  # their other methods draw through these
            if not isinstance(generator, random.Random):
                continue
            for name in _DRAWING_METHODS:
                what = f"{type(generator).__name__}.{name}"
                stack.enter_context(patched(generator, name, _recording(draws, generator, what, getattr(generator, name))))
        try:
            yield
        finally:
            draws.restore()
            changed = False
            for generator, state in before:  # also after a library's draws from them
                if not _same_state(_state(generator), state):
                    _set_state(generator, state)
                    changed = True
    if draws.first is None and changed and not draws.by_library:  # through a function not patched
        draws.first = ("from a global generator, through a function not seen", "", "")
    if draws.first is not None:
        what, where, line = draws.first
        module = f"module {where!r}" if where else "the root module"
        raise RandomDraw(
            f"{type(model).__name__}: the code of {module} draws random numbers ({what}{' at ' if line else ''}{line}): "
            "a trace would keep one draw for every call; its own code is measured on each call instead",
            module=where,
        )
