"""Generation counted: ``Instrumented.generate`` runs the model's own ``generate`` (transformers'
``GenerationMixin``) with every forward it makes going through the wrapper's counting path.

``generate`` calls the model itself (``self(**model_inputs)``), never the wrapper. For the duration of
one ``generate`` call, in the calling thread only, the model's top-level forward is routed through
the wrapper (:func:`counting_own_calls`): an instance-level ``forward`` that looks the call's program
up, runs the model's forward and adds the count, marked ``fxflops_own`` so that call situations do
not take it for a change of the model. Another thread calling the model meanwhile, a capture's trace
and the model's calls to itself run the model's forward unchanged; the previous ``forward`` (a
framework's own instance-level override included) is put back when ``generate`` returns or raises.

transformers >= 5 encodes a VLM's images and videos before the prefill, outside the forward (its
base model's ``get_image_features`` / ``get_video_features``), once per image, and hands the features
over as ``mm_encoder_outputs`` (expanded for beams and returned sequences, kept for the steps of a
generation without cache). Those calls are routed alike for the generating threads and counted, op by
op (``fxflops/islands.py``), in the ``prefill`` phase: the model computes what it computes without
fxflops. An encoder-decoder
model's encoder also runs outside the forward: its ``generate`` is not counted (a warning, and the
calls are in ``uncounted``) rather than counted without its encoder.

The forwards transformers' prefill stage makes (``GenerationMixin._prefill``, routed alike for the
generating threads: the prompt, in a VLM the images, and every chunk of a chunked prefill,
``prefill_chunk_size``) are the ``prefill`` phase; every later forward is a ``decode`` step (with a
``generate`` that has no prefill stage, the first forward is the prefill). A key-value cache's
tensors are inputs of the trace whose length is a symbol (``capture/inputs.py``), so one prefill
program and one decode program serve every step of every request.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


ROUTED = ("forward", "_prefill")  # the model's methods a route replaces for the generating threads
ENCODERS = ("get_image_features", "get_video_features")  # the base model's, run by generate before the prefill
ENCODE = "encode"  # the phase a routed encoder call is counted with (as the prefill's work)


@dataclass
class _Generating:
    """One thread's ``generate`` call through a route."""

    count: Callable[..., Any]
    calls: int = 0  # forwards counted so far
    depth: int = 0  # > 0 while a counted forward runs (the model calling itself is not another call)
    prefilling: int = 0  # > 0 inside transformers' prefill stage (every chunk of a chunked prefill)


class _Route:
    """The routed forward (and prefill stage, and its base model's image and video encoders)
    installed on one model while any thread generates through it: one dispatcher, each generating
    thread with its own count function and counters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.previous = {name: vars(model).get(name) for name in ROUTED}  # a framework's own overrides, or None
        self.threads: dict[int, _Generating] = {}
        self.base = getattr(model, "base_model", model)
        self.encoders = {
            name: self._counted(getattr(self.base, name), lambda state: ENCODE, False)
            for name in ENCODERS if callable(getattr(self.base, name, None))
        }
        self.previous_encoders = {name: vars(self.base).get(name) for name in self.encoders}
        prefill = getattr(model, "_prefill", None)  # transformers >= 5: the prefill stage is its own method

        def phase(state: _Generating) -> str:
            if prefill is not None:
                return "prefill" if state.prefilling else "decode"
            return "prefill" if state.calls == 0 else "decode"  # no prefill stage to watch: the first forward is the prompt's

        self.methods = {"forward": self._counted(model.forward, phase, True)}
        if prefill is not None:

            @functools.wraps(prefill)
            def prefill_stage(*args: Any, **kwargs: Any) -> Any:
                state = self.threads.get(threading.get_ident())
                if state is None:
                    return prefill(*args, **kwargs)
                state.prefilling += 1
                try:
                    return prefill(*args, **kwargs)
                finally:
                    state.prefilling -= 1

            prefill_stage.fxflops_own = True
            prefill_stage.fxflops_wraps = prefill
            self.methods["_prefill"] = prefill_stage

    def _counted(self, original: Callable[..., Any], phase: Callable[[_Generating], str], call: bool) -> Callable[..., Any]:
        """``original`` (the model's forward; an encoder method of its base model) counted as
        ``phase(state)`` when a generating thread calls it outside a counted forward (``call``: one
        of the forwards it counts); run as it is otherwise (another thread, the model calling itself)."""

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            state = self.threads.get(threading.get_ident())
            if state is None or state.depth:  # inside a forward: part of its count
                return original(*args, **kwargs)
            now = phase(state)
            state.calls += call
            state.depth += 1
            try:
                return state.count(now, original, args, kwargs)
            finally:
                state.depth -= 1

        counted.fxflops_own = True
        counted.fxflops_wraps = original  # what a capture's twin of the model runs (capture/isolation.py)
        return counted


_ROUTES: dict[int, _Route] = {}  # id(model) -> its route, while some thread generates
_ROUTES_LOCK = threading.Lock()


@contextlib.contextmanager
def counting_own_calls(model: torch.nn.Module, count: Callable[..., Any]) -> Iterator[_Generating]:
    """For the block, in this thread: ``model``'s own top-level calls run ``count(phase, forward,
    args, kwargs)`` instead of ``forward(*args, **kwargs)`` (see the module docstring); yields the
    thread's counters (``calls``: the forwards counted). Threads
    generating through one model at once share its route; the last one out puts the model back."""
    me = threading.get_ident()
    with _ROUTES_LOCK:
        route = _ROUTES.get(id(model))
        if route is None:
            route = _ROUTES[id(model)] = _Route(model)
            vars(model).update(route.methods)
            vars(route.base).update(route.encoders)
        outer = route.threads.get(me)  # a generate inside a generate (same thread) counts on its own
        route.threads[me] = state = _Generating(count)
    try:
        yield state
    finally:
        with _ROUTES_LOCK:
            if outer is not None:
                route.threads[me] = outer
            else:
                del route.threads[me]
            if not route.threads:
                del _ROUTES[id(model)]
                _put_back(model, route.methods, route.previous)
                _put_back(route.base, route.encoders, route.previous_encoders)


def _put_back(owner: Any, routed: dict[str, Any], previous: dict[str, Any]) -> None:
    """The methods a route replaced on ``owner`` as they were (an instance's own, or the class's)."""
    for name in routed:
        if previous[name] is None:
            vars(owner).pop(name, None)
        else:
            vars(owner)[name] = previous[name]


def generated_tokens(model: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> int:
    """Tokens a ``generate`` call produced, over all returned rows: the returned sequences less the
    prompt (decoder-only models return prompt + new tokens; encoder-decoders the decoder start token
    + new tokens; with ``inputs_embeds`` only the new ones)."""
    sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2:
        return 0
    rows, length = sequences.shape
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return rows * max(length - 1, 0)
    prompt = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    prompt_length = prompt.shape[-1] if isinstance(prompt, torch.Tensor) else 0
    return rows * max(length - prompt_length, 0)
