"""What Phi-4-multimodal's image and audio embeddings share (``adapters/crops.py``, ``adapters/audio.py``):
an embedding module that writes its modality's features to the positions of its token in
``input_ids``, called by the feature embedding around it only ``if (input_ids == token).any()``.

Such a piece is found once per model (exactly one module of the shape its subclass tests, the token
named by that module's config); a call with the modality's input and at least one of its tokens has
the derived size :class:`~fxflops.capture.derived.TokenCount` (the elements of ``input_ids`` equal to
the token, guarded ≥ 1, which decides the ``.any()``); while capturing, the subclass puts its
stand-ins on the capture's twin (:func:`standing_in`) and the feature embedding runs its own code with
the ``.any()`` of its token test True (:class:`TokensPresent`).
"""

from __future__ import annotations

import abc
import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fxflops.capture.derived import TokenCount

IDS = "input_ids"


class TokensPresent(TorchFunctionMode):
    """While active: ``.any()`` of ``ids == token`` (``ids`` the traced ``input_ids``) is True, as the
    program's guard (at least one such token) makes it; every other op as is."""

    def __init__(self, ids: torch.Tensor, token: int) -> None:
        super().__init__()
        self.ids, self.token, self.tests = ids, token, []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.any and len(args) == 1 and not kwargs and any(args[0] is t for t in self.tests):
            return True
        out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.__eq__, torch.eq) and len(args) == 2 and args[0] is self.ids and isinstance(args[1], int) and args[1] == self.token:
            self.tests.append(out)
        return out


class TokenEmbedding(abc.ABC):
    """One model's embedding of a modality onto its tokens (see the module docstring). Subclasses
    name the derived size (``TOKENS``), the modality's input (``INPUT``), where the owner's config
    keeps the token (``CONFIG``, ``TOKEN_ID``), what their stand-ins leave out of the trace
    (``LEFT_OUT``), and test a module's shape (:meth:`is_owner`)."""

    TOKENS: str
    INPUT: str
    CONFIG: str
    TOKEN_ID: str
    LEFT_OUT: str

    def __init__(self, owner: str, token: int) -> None:
        self.owner, self.token = owner, token

    @staticmethod
    @abc.abstractmethod
    def is_owner(module: torch.nn.Module) -> bool:
        """Whether ``module`` is this modality's embedding (its parts and forward's inputs)."""

    @classmethod
    def of(cls, model: torch.nn.Module, signature: inspect.Signature) -> TokenEmbedding | None:
        """The piece for ``model`` when exactly one of its (non-root) modules is such an embedding,
        its config names the token, and the model's forward takes the modality's input and ``input_ids``."""
        if not {cls.INPUT, IDS} <= set(signature.parameters):
            return None
        owners = [(path, m) for path, m in model.named_modules() if cls.is_owner(m)]
        if len(owners) != 1 or not owners[0][0]:
            return None
        (path, owner), = owners
        token = getattr(getattr(getattr(owner, "config", None), cls.CONFIG, None), cls.TOKEN_ID, None)
        return cls(path, token) if isinstance(token, int) else None

    def derived_sizes(self, call: dict[str, Any]) -> tuple[TokenCount, ...]:
        """The tokens of a call with the modality's input and at least one of them."""
        ids, media = call.get(IDS), call.get(self.INPUT)
        if not (isinstance(ids, torch.Tensor) and isinstance(media, torch.Tensor)):
            return ()
        tokens = TokenCount(self.TOKENS, (IDS,), least=1, token=self.token, leaves_out=self.LEFT_OUT)
        return (tokens,) if tokens.value(ids) >= tokens.least else ()

    def feature_embedding(self, model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
        """(the module calling the owner, a stand-in for its forward: its own code with the token test's
        ``.any()`` True)."""
        parent = model.get_submodule(self.owner.rpartition(".")[0])
        own = parent.forward

        def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with TokensPresent(input_ids, self.token):
                return own(input_ids, *args, **kwargs)

        return parent, forward


def has_parts(module: torch.nn.Module, linears: tuple[str, ...], inputs: set[str]) -> bool:
    """Whether ``module`` holds a linear layer under each name of ``linears`` and its forward takes
    every input named in ``inputs`` (the shape an owner's test checks, besides its own parts)."""
    if not all(isinstance(getattr(module, name, None), torch.nn.Linear) for name in linears):
        return False
    try:
        return inputs <= set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False


def written_to_tokens(owner: torch.nn.Module, inputs_embeds: torch.Tensor, rows: torch.Tensor, tokens: Any) -> torch.Tensor:
    """A stand-in embedding's output: ``rows`` written to the first ``tokens`` rows of
    ``inputs_embeds`` (which rows changes no counted work), through the owner's dropout."""
    flat = inputs_embeds.reshape(-1, inputs_embeds.shape[-1])
    first = torch.arange(tokens, device=flat.device)
    written = flat.index_put((first,), rows.to(dtype=flat.dtype, device=flat.device)).view_as(inputs_embeds)
    drop = getattr(owner, "drop", None)
    return drop(written) if isinstance(drop, torch.nn.Module) else written


@contextlib.contextmanager
def standing_in(stand_ins: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``(object, name, stand_in)``: ``stand_in`` in the object's ``__dict__`` under ``name`` while
    active (the capture's twin only), what was there before put back after (another piece's stand-in)."""
    before = [(obj, name, vars(obj).get(name, _ABSENT)) for obj, name, _ in stand_ins]
    for obj, name, stand_in in stand_ins:
        obj.__dict__[name] = stand_in
    try:
        yield
    finally:
        for obj, name, value in reversed(before):
            if value is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value


_ABSENT = object()
