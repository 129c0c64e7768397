"""Deprecated location of the Hugging Face adapter: it is :mod:`fxflops.adapters.transformers`."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    import fxflops.adapters.transformers as moved

    value = getattr(moved, name)  # AttributeError for a name the adapter does not have
    warnings.warn(
        f"fxflops.integrations.transformers.{name} moved to fxflops.adapters.transformers.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
