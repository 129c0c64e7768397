"""Model-family adapters: what a family needs, beyond its own code, to be captured and bound.

The capture receives an adapter (``capture(adapter=...)``) and only knows the interface,
:class:`~fxflops.capture.adapters.Adapter` (the identity a plain PyTorch model gets). A family's
adapter is a file here: ``transformers.py`` for Hugging Face ``PreTrainedModel`` (with ``pieces.py``,
per-image pieces kept packed while capturing). Adding a family adds a file and a line in
:func:`adapter_for`, never a branch in the capture or the analysis.
"""

from __future__ import annotations

import sys
from typing import Any

from fxflops.capture.adapters import Adapter


def adapter_for(model: Any) -> Adapter:
    """The adapter for ``model``'s family, else the identity. A family's module is imported only when
    the model is an instance of it (``transformers`` is never imported by fxflops itself)."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        from fxflops.adapters.transformers import TransformersAdapter

        return TransformersAdapter(model)
    return Adapter()


__all__ = ["Adapter", "adapter_for"]
