"""Per-item pieces kept packed: ``torch.cat(torch.split(x, sizes.tolist()))`` traced without pinning
the number of items.

Vision-language models cut the packed output of their vision tower into one piece per image,
``torch.split(features, (grid_thw.prod(-1) // 4).tolist())`` (Qwen2-VL and its successors) or
``list(features)`` (LLaVA), and concatenate the pieces again before scattering them into the text
embeddings. Splitting and concatenating move data and do no arithmetic, and

    cat(split(x, [n₁, …, n_k]), dim=0) = x,   cat(unbind(x, 0), dim=0) = x.flatten(0, 1),

but a symbolic trace cannot make a Python list of k pieces without fixing k, the number of images.

:func:`packed_pieces` wraps named methods of a model (the *feature getters*) for the duration of a
capture (on the twin of the module tree the capture traces, ``capture/isolation.py``; the tensor
methods below are patched for the capturing thread only, ``capture/scope.py``). Inside one of them,
and only there:

- ``tensor.tolist()`` of an integer tensor whose length is a free size symbol returns a
  :class:`SymbolicSections` placeholder instead of a list of fixed length;
- ``torch.split(x, sections)`` / ``x.split(sections)`` given that placeholder returns ``(x,)``: the
  pieces, still packed, as one piece;
- iterating over a tensor whose dim 0 is a free size symbol (``list(features)``) yields one piece
  ``x.flatten(0, 1)`` (its ``len()`` raises ``TypeError``, so that ``list()`` iterates instead of
  asking for a number);
- iterating over a 2-D integer tensor whose dim 0 is a free size symbol (``for h, w in
  image_sizes``, LightOnOCR) yields one :class:`SymbolicRow`, whose columns are
  :class:`SymbolicValue` placeholders: integer arithmetic on them gives placeholders again, and a
  list of them given to ``torch.split`` is the sections placeholder above.

In the graph (Qwen2-VL, ``P`` packed patches of ``images`` images)::

    before (cannot trace):  sizes = (grid.prod(-1) // 4).tolist()     # a list of `images` numbers
                            pieces = torch.split(features, sizes)     # `images` nodes
                            embeds = torch.cat(pieces)                # [P // 4, D]
    after:                  embeds = features                         # the one piece, [P // 4, D]

Any other use of the placeholder (indexing it, zipping it with per-image data) raises
:class:`~fxflops.errors.CaptureError` naming the feature getter, so a model that needs the pieces one
by one is refused rather than counted wrong. Nested captures (a lifted module's one-segment trace)
see sizes that are numbers and are unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxflops.capture.scope import patched
from fxflops.errors import CaptureError


class SymbolicSections:
    """The per-item sizes of a ``.tolist()`` whose length is a free symbol; only ``split`` takes it."""

    def __init__(self, tensor: torch.Tensor, getter: str) -> None:
        self.tensor = tensor
        self.getter = getter

    def _refuse(self, *args: Any) -> Any:
        raise CaptureError(
            f"{self.getter} uses per-item sizes (a .tolist() over a symbolic number of items) other than "
            "to torch.split a packed tensor; fxflops cannot trace it without fixing the number of items"
        )

    __iter__ = __len__ = __getitem__ = __bool__ = _refuse


class SymbolicValue:
    """One item's number computed from a row of per-item metadata over a symbolic number of items
    (``(h // 28) * (w // 28)`` for each ``h, w`` of ``image_sizes``): integer arithmetic gives another
    placeholder; only a list of them given to ``split`` takes it (any other use refuses)."""

    def __init__(self, getter: str) -> None:
        self.getter = getter

    def _same(self, *args: Any) -> SymbolicValue:
        return SymbolicValue(self.getter)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __floordiv__ = __rfloordiv__ = __mod__ = _same

    def _refuse(self, *args: Any) -> Any:
        raise CaptureError(
            f"{self.getter} uses per-item values (a row of metadata over a symbolic number of items) other "
            "than to torch.split a packed tensor; fxflops cannot trace it without fixing the number of items"
        )

    __iter__ = __len__ = __getitem__ = __bool__ = __int__ = __index__ = __float__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __hash__ = None  # type: ignore[assignment]


class SymbolicRow:
    """A row of a 2-D integer tensor over a symbolic number of items: its columns, as placeholders."""

    def __init__(self, columns: int, getter: str) -> None:
        self.columns, self.getter = columns, getter

    def __iter__(self) -> Iterator[SymbolicValue]:
        return iter([SymbolicValue(self.getter) for _ in range(self.columns)])

    def __getitem__(self, index: int) -> SymbolicValue:
        if not isinstance(index, int) or not -self.columns <= index < self.columns:
            return SymbolicValue(self.getter)._refuse()
        return SymbolicValue(self.getter)


def _sections(sizes: Any) -> bool:
    """``sizes`` is a per-item placeholder: a ``.tolist()``'s, or a list of :class:`SymbolicValue`."""
    return isinstance(sizes, SymbolicSections) or (isinstance(sizes, (list, tuple)) and any(isinstance(v, SymbolicValue) for v in sizes))


def _symbolic_length(tensor: torch.Tensor) -> bool:
    """Dim 0 of ``tensor`` is a size expression with a free symbol (not a number)."""
    return tensor.dim() >= 1 and isinstance(tensor.shape[0], torch.SymInt) and not tensor.shape[0].node.expr.is_number


@contextlib.contextmanager
def packed_pieces(owners: list[Any], getters: tuple[str, ...]) -> Iterator[None]:
    """For the duration of a capture, run the methods named ``getters`` of each of ``owners`` (those
    it has) with per-item pieces kept packed (see the module docstring)."""
    wrapped = [(owner, name) for owner in owners for name in getters if callable(getattr(owner, name, None))]
    if not wrapped:
        yield
        return
    inside: list[str] = []  # the feature getters being run, innermost last (capturing thread only)

    def sections_or(original: Any) -> Any:
        def tolist(self: torch.Tensor) -> Any:
            if inside and _symbolic_length(self) and not self.dtype.is_floating_point:
                return SymbolicSections(self, inside[-1])
            return original(self)

        return tolist

    def split(tensor: torch.Tensor, split_size_or_sections: Any, dim: int = 0) -> Any:
        if _sections(split_size_or_sections):
            return (tensor,)
        return split_function(tensor, split_size_or_sections, dim)

    def split_method_(self: torch.Tensor, split_size: Any, dim: int = 0) -> Any:
        if _sections(split_size):
            return (self,)
        return split_method(self, split_size, dim)

    def iterate(self: torch.Tensor) -> Iterator[Any]:
        if inside and self.dim() == 2 and _symbolic_length(self) and not self.dtype.is_floating_point and isinstance(self.shape[1], int):
            return iter((SymbolicRow(self.shape[1], inside[-1]),))  # for h, w in image_sizes: one row of placeholders
        if inside and self.dim() >= 2 and _symbolic_length(self):
            return iter((self.flatten(0, 1),))
        return tensor_iter(self)

    def length(self: torch.Tensor) -> int:
        if inside and self.dim() >= 2 and _symbolic_length(self):
            # list(x) asks for a length first; TypeError makes it just iterate (one packed piece)
            raise TypeError("the number of items is symbolic")
        return tensor_len(self)

    def wrap(owner: Any, name: str, method: Any) -> Any:
        def getter(*args: Any, **kwargs: Any) -> Any:
            inside.append(f"{type(owner).__name__}.{name}")
            try:
                return method(*args, **kwargs)
            finally:
                inside.pop()

        return getter

    own = {(id(owner), name): owner.__dict__[name] for owner, name in wrapped if name in owner.__dict__}
    for owner, name in wrapped:
        setattr(owner, name, wrap(owner, name, getattr(owner, name)))
    try:
        with contextlib.ExitStack() as stack:
            tensor_tolist = stack.enter_context(patched(torch.Tensor, "tolist", lambda self: tolist_tensor(self)))
            fake_tolist = stack.enter_context(patched(FakeTensor, "tolist", lambda self: tolist_fake(self)))
            tolist_tensor, tolist_fake = sections_or(tensor_tolist), sections_or(fake_tolist)
            split_function = stack.enter_context(patched(torch, "split", split))
            split_method = stack.enter_context(patched(torch.Tensor, "split", split_method_))
            tensor_iter = stack.enter_context(patched(torch.Tensor, "__iter__", iterate))
            tensor_len = stack.enter_context(patched(torch.Tensor, "__len__", length))
            yield
    finally:
        for owner, name in wrapped:
            if (id(owner), name) in own:
                setattr(owner, name, own[(id(owner), name)])
            else:
                delattr(owner, name)
