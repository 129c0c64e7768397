"""Capture: model + example call + named dims -> symbolic FX graph (see ``trace.py``)."""

from fxflops.capture.trace import Captured, Guard, capture

__all__ = ["Captured", "Guard", "capture"]
