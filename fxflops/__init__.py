"""fxflops: exact FLOPs of PyTorch models from their own traced graph.

Public API: :func:`trace` (model -> :class:`Program`), :func:`instrument` (a counting wrapper with a
:class:`Meter`), :func:`backend` (a counting ``torch.compile`` backend), :func:`verify` (hand formulas
against the traced ones), :mod:`fxflops.rules` (the op -> FLOPs registry), :mod:`fxflops.conventions`
and the errors in :mod:`fxflops.errors`. Only these names are exported; the stages behind them are
described in the README's layout section.
"""

from fxflops import conventions, ops, rules
from fxflops.analysis.terms import Term, Unsupported
from fxflops.build import trace
from fxflops.compile import backend
from fxflops.conventions import Convention
from fxflops.errors import (
    CaptureError,
    FxFlopsError,
    GuardError,
    InputError,
    MetadataError,
    PinnedSymbolError,
    UnboundSymbolError,
)
from fxflops.instrument import Instrumented, instrument
from fxflops.meter import Meter
from fxflops.program import Program
from fxflops.verify import Verdict, verify

__all__ = [
    "CaptureError",
    "Convention",
    "FxFlopsError",
    "GuardError",
    "InputError",
    "Instrumented",
    "MetadataError",
    "Meter",
    "PinnedSymbolError",
    "Program",
    "Term",
    "UnboundSymbolError",
    "Unsupported",
    "Verdict",
    "backend",
    "conventions",
    "instrument",
    "ops",
    "rules",
    "trace",
    "verify",
]
