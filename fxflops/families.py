"""Which adapter (``capture/adapters.py``) a model's family gets: a Hugging Face ``PreTrainedModel``
the transformers adapter (``integrations/transformers.py``), anything else the identity. The family's
module is imported only when the model is an instance of it.
"""

from __future__ import annotations

import sys
from typing import Any

from fxflops.capture.adapters import Adapter


def adapter_for(model: Any) -> Adapter:
    """The adapter for ``model``'s family, else the identity."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        from fxflops.integrations.transformers import TransformersAdapter

        return TransformersAdapter(model)
    return Adapter()
