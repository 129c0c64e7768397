"""A ShapeEnv that blames the model's own source line for every guard and replacement.

torch's ShapeEnv attributes a guard to the first frame outside a fixed list of "uninteresting" torch
files; under the module-stack tracer that is ``nn/modules/module.py``. fxflops needs the user's line
("``seq`` was pinned by ``model.py:42``"), so this subclass skips every frame inside torch and fxflops.
"""

from __future__ import annotations

import linecache
import os
import sys
import traceback
import types

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

_FXFLOPS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fxflops/capture/.. (not the package: a cycle)
_SKIPPED_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _FXFLOPS_DIR + os.sep)
_MODEL_DIR = os.path.join(_FXFLOPS_DIR, "models") + os.sep


def is_library_file(filename: str) -> bool:
    """True for files of torch or fxflops (never the place a model pins a size), except fxflops' own
    example models."""
    path = os.path.abspath(filename)
    return (path.startswith(_SKIPPED_DIRS) and not path.startswith(_MODEL_DIR)) or filename.startswith("<")


class BlamingShapeEnv(ShapeEnv):
    """ShapeEnv whose guard locations are the innermost frame of model code.

    No duck sizing (two inputs of equal example size stay distinct symbols) and no 0/1 specialisation.
    No event recording (torch keeps it to replay a ShapeEnv when debugging; ~10% of capture time).
    """

    def __init__(self) -> None:
        super().__init__(duck_shape=False, specialize_zero_one=False, should_record_events=False)

    def _get_user_frame(self) -> types.FrameType | None:
        frame = sys._getframe()
        while frame is not None and is_library_file(frame.f_code.co_filename):
            frame = frame.f_back
        return frame


def format_location(loc: object) -> str:
    """``path:line in function`` plus the source line, from a FrameSummary or a string."""
    if isinstance(loc, traceback.FrameSummary):
        code = (loc.line or linecache.getline(loc.filename, loc.lineno or 0)).strip()
        where = f"{loc.filename}:{loc.lineno} in {loc.name}"
        return f"{where}: {code}" if code else where
    return str(loc) if loc else "an unknown location"
