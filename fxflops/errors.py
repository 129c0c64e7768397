"""Errors fxflops raises. Each names the module, input or symbol involved and what to do about it."""


class FxFlopsError(Exception):
    """Base class of every fxflops error."""


class CaptureError(FxFlopsError):
    """The model could not be traced symbolically (data-dependent code, unsupported construct).

    ``module`` is the path of the innermost module whose code failed (``""``: the root's own code),
    where the trace found it; ``None`` when the failure has no place in the module tree. A call whose
    capture failed at a module is counted by measuring that module's own code (``fxflops/islands.py``);
    one whose symbolic trace failed where no module can be named (``in_trace``: torch's own code
    refusing a symbolic size) by measuring the whole call, at that size class.
    """

    def __init__(self, *args: object, module: str | None = None, in_trace: bool = False) -> None:
        super().__init__(*args)
        self.module, self.in_trace = module, in_trace


class PinnedSymbolError(CaptureError):
    """A requested free symbol was pinned to a constant or merged with another symbol by the model."""


class OtherThreadError(CaptureError):
    """The model's code ran the call's tensors on another thread (a thread pool in its forward).
    Neither a trace nor a measurement sees that work (tracing and dispatch modes are per thread),
    so the call is not counted (never measured: ``module`` stays None)."""


class UnboundSymbolError(FxFlopsError):
    """A program was evaluated without a value for one of its symbols."""


class GuardError(FxFlopsError):
    """Symbol values fall outside the guards the trace relied on, so the polynomial would not be exact."""


class InputError(FxFlopsError):
    """A call's inputs do not match what the program was captured with (missing tensor, wrong rank)."""


class MetadataError(FxFlopsError):
    """Segment metadata is malformed: offsets that decrease or overrun the packed length, a grid
    inconsistent with the patches it describes. The message names the input."""


def warn(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` that never raises: telemetry's warnings must not stop a training
    step, also when the user's filters turn warnings into errors (``-W error``,
    ``warnings.simplefilter("error")``, pytest's ``-W error``)."""
    import warnings

    try:
        warnings.warn(message, stacklevel=stacklevel + 1)
    except Exception:  # noqa: BLE001 - a warning filter set to "error": the message is dropped, the step goes on
        pass
