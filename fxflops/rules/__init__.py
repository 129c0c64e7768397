"""FLOPs rules: one registry (``registry.py``) and one module per op family.

Importing this package registers every built-in rule.
"""

from fxflops.rules import attention, conv, elementwise, matmul, varlen  # noqa: F401  (registration side effect)
from fxflops.rules.registry import (
    Entry,
    entry_for,
    overlaid,
    per_use_entries,
    register,
    registered_ops,
    registry_version,
    rule_for,
    segment_args,
    shape_of,
    unregister,
)

__all__ = ["Entry", "entry_for", "overlaid", "per_use_entries", "register", "registered_ops", "registry_version", "rule_for", "segment_args", "shape_of", "unregister"]
