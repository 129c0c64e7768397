"""Adapters: what a model family needs, beyond its own code, to be captured and bound.

A plain PyTorch model needs nothing: :class:`Adapter` is the identity. A family whose forward derives
metadata with Python loops over tensor values (Hugging Face VLMs compute M-RoPE positions and vision
windows that way) gets an adapter that

- ``prepare``: derives that metadata from the call itself, before the model runs, and passes it in the
  keyword arguments the family's code reads instead of computing it (the model then skips its loops,
  so the work is moved, not added);
- ``dims``: names the call's dims (``batch``, ``seq``, ``patches``) when the user names none;
- ``per_segment``: the modules to lift per segment (see ``capture/lifting.py``);
- ``derived_sizes``: sizes the model computes from the values of a metadata input, which no input
  shape carries (``capture/derived.py``): each a symbol of the capture, computed by the binder per call;
- ``capturing``: a context held during the capture only, given the module tree the trace runs on
  and the derived sizes' symbolic values (``fxflops/adapters/pieces.py``);
- ``same_layer_attributes``: attributes that differ between a stack's layers without changing what
  they compute, so identical layers are still traced once (``capture/reuse.py``).

A model family's adapter is a file in ``fxflops/adapters/``, picked by ``adapter_for`` from the
model's type; the capture only receives it (``capture(adapter=...)``).
"""

from __future__ import annotations

import contextlib

import torch

from fxflops.capture.derived import DerivedSize, TracedSize


class Adapter:
    """The identity adapter: the model is captured and bound from the call as given."""

    per_segment: dict[str, str] = {}
    same_layer_attributes: frozenset[str] = frozenset()  # attributes layer reuse may ignore (capture/reuse.py)
    # Python int arguments traced as symbols, not keyed by value: a length that changes on every call
    # (a packing collator's max_length_q); a call key holds their type only, the binder reads them
    symbolic_arguments: frozenset[str] = frozenset()

    def prepare(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call the model runs and the program binds: here the call itself."""
        return args, kwargs

    def dims(self, args: tuple, kwargs: dict) -> dict[str, dict[int, str]] | None:
        """Names for the call's dims when the user gives none; ``None``: every dim ``<argument>_<dim>``."""
        return None

    def derived_sizes(self, args: tuple, kwargs: dict) -> tuple[DerivedSize, ...]:
        """The sizes of this (prepared) call that only the values of its metadata carry."""
        return ()

    def capturing(self, model: torch.nn.Module, sizes: dict[str, TracedSize]) -> contextlib.AbstractContextManager:
        """A context held while capturing ``model`` (the twin of the user's model the trace runs on,
        ``capture/isolation.py``: changes to it never reach the user's objects); ``sizes``: each
        derived size's SymInt in the trace, and the fake input it comes from."""
        return contextlib.nullcontext()
