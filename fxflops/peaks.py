"""Dense peak FLOP/s of accelerators per dtype, for MFU/HFU. Unknown means ``None``, never a guess.

:func:`lookup_peak` maps a device (``None``, a ``torch.device``, a string such as ``"cuda:0"``, or a
device name as ``torch.cuda.get_device_name()`` reports it) and a dtype to ``(flops_per_second,
source)``, or to ``(None, reason)`` when the table has no figure (CPU, an unknown name, a dtype
without a column). :func:`register_peak` adds or replaces an entry; :data:`PEAKS` is the table.

Figures are per device as torch sees it (one GPU), DENSE: no 2:4 structured sparsity. Where a
datasheet prints a figure "with sparsity", the entry holds half of it and its source says so.

Columns. ``"bf16"``, ``"fp16"`` and ``"fp8"`` are tensor-core peaks (``torch.float8_e4m3fn``,
``float8_e5m2`` and their ``fnuz`` variants all read ``"fp8"``). ``torch.float32`` reads one of two
columns, because a float32 matmul runs on different units depending on a global setting:

* ``"tf32"``: the TF32 tensor-core peak, when float32 matmuls may use TF32, i.e. when
  ``torch.backends.cuda.matmul.fp32_precision == "tf32"``. That getter also reflects the legacy
  switches (``torch.backends.cuda.matmul.allow_tf32 = True``,
  ``torch.set_float32_matmul_precision("high"/"medium")``) and the generic
  ``torch.backends.fp32_precision``; unlike the legacy getters it never raises when old and new APIs
  were mixed. Pass ``tf32=`` to :func:`lookup_peak` to decide explicitly.
* ``"fp32"``: the plain (non-tensor-core) FP32 peak otherwise, PyTorch's default.

AMD entries have no ``"tf32"`` figure on purpose: the datasheets print one, but whether PyTorch on
ROCm runs float32 matmuls as TF32 depends on the ROCm/hipBLASLt build and environment, so a float32
lookup with TF32 allowed on an AMD GPU is unknown (pass ``peak_flops``).

Name matching. Names and patterns are split into lower-case alphanumeric tokens (``"NVIDIA
A100-SXM4-80GB"`` -> ``nvidia a100 sxm4 80gb``). A pattern matches when all its tokens are tokens of
the name and none of its ``!``-prefixed tokens is; whole tokens, so ``"L4"`` does not match ``"NVIDIA
L40S"`` nor ``"A100"`` ``"NVIDIA A100X"``. Among the entries of the dtype's column that match, the
one with the most tokens wins; on a tie the later entry (so a registered one) wins. A name with the
token ``mig`` (a MIG slice, e.g. ``"NVIDIA A100-SXM4-40GB MIG 3g.20gb"``) only matches patterns that
name ``mig`` themselves, since every figure here is a whole-GPU peak. Likewise an AMD GPU in a
CPX/partitioned compute mode reports its full name but holds a fraction of the chip: pass
``peak_flops`` there.

Names as vendors report them (``cudaGetDeviceProperties().name`` / the libdrm ``amdgpu.ids`` table):

* NVIDIA: ``"NVIDIA H100 80GB HBM3"`` (H100 SXM5), ``"NVIDIA H100 PCIe"``, ``"NVIDIA H100 NVL"``,
  ``"NVIDIA H200"`` (SXM), ``"NVIDIA H200 NVL"``, ``"NVIDIA B200"``, ``"NVIDIA GB200"``,
  ``"NVIDIA A100-SXM4-80GB"``, ``"NVIDIA A100-SXM4-40GB"``, ``"NVIDIA A100-PCIE-40GB"``,
  ``"NVIDIA A100 80GB PCIe"``, ``"NVIDIA L40S"``, ``"NVIDIA L4"``.
* AMD (ROCm, through ``torch.cuda``): ``"AMD Instinct MI300X"``, ``"AMD Instinct MI325X"``. Some
  ROCm builds without the amdgpu.ids table report ``"AMD Radeon Graphics"``: unknown, by design.

Not in the table (no figure confirmed from a vendor datasheet, or none that is right per torch
device): H100 NVL, H200 NVL, A10G, MI250X (its datasheet figure is per OAM module of two GCDs, each
a separate torch device, and ROCm names it ``"AMD Instinct MI250X / MI250"``, two parts with
different peaks). Register them with :func:`register_peak`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_COLUMN_OF = {torch.bfloat16: "bf16", torch.float16: "fp16", **dict.fromkeys(_FP8, "fp8")}
COLUMNS = ("bf16", "fp16", "fp8", "tf32", "fp32")
_ASK = "pass peak_flops=..."


@dataclass(frozen=True)
class PeakEntry:
    """One figure: devices whose name matches ``pattern`` peak at ``flops`` FLOP/s in ``dtype``.

    ``dtype`` is a column of :data:`COLUMNS`; ``source`` names the datasheet and the figure as
    printed (and the halving when it was printed with sparsity)."""

    pattern: str
    dtype: str
    flops: float
    source: str


def _rows(patterns: tuple[str, ...], figures: dict[str, tuple[float, str]], sheet: str) -> tuple[PeakEntry, ...]:
    """The entries of one device: each pattern by each ``column: (flops, figure as printed)``."""
    return tuple(
        PeakEntry(pattern, column, flops, f"{sheet}: {printed}")
        for pattern in patterns
        for column, (flops, printed) in figures.items()
    )


_T = 1e12
_P = 1e15
_HALF = "with sparsity, halved to dense"

_H100_SXM = {
    "bf16": (1979 / 2 * _T, f"BFLOAT16 Tensor Core 1,979 TFLOPS* ({_HALF})"),
    "fp16": (1979 / 2 * _T, f"FP16 Tensor Core 1,979 TFLOPS* ({_HALF})"),
    "fp8": (3958 / 2 * _T, f"FP8 Tensor Core 3,958 TFLOPS* ({_HALF})"),
    "tf32": (989 / 2 * _T, f"TF32 Tensor Core 989 TFLOPS* ({_HALF})"),
    "fp32": (67 * _T, "FP32 67 TFLOPS"),
}
_MI300 = {
    "bf16": (1307.4 * _T, "Peak bfloat16 1307.4 TFLOPS (dense; 2614.9 with sparsity)"),
    "fp16": (1307.4 * _T, "Peak FP16 1307.4 TFLOPS (dense; 2614.9 with sparsity)"),
    "fp8": (2614.9 * _T, "Peak FP8 2614.9 TFLOPS (dense; 5229.8 with sparsity)"),
    "fp32": (163.4 * _T, "Peak single precision (FP32) vector and matrix 163.4 TFLOPS"),
}

PEAKS: tuple[PeakEntry, ...] = (
    *_rows(
        ("H100 80GB HBM3", "H100 SXM5 80GB"),
        _H100_SXM,
        "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 SXM column",
    ),
    *_rows(
        ("H100 PCIe",),
        {
            "bf16": (1513 / 2 * _T, f"BFLOAT16 Tensor Core 1,513 TFLOPS* ({_HALF})"),
            "fp16": (1513 / 2 * _T, f"FP16 Tensor Core 1,513 TFLOPS* ({_HALF})"),
            "fp8": (3026 / 2 * _T, f"FP8 Tensor Core 3,026 TFLOPS* ({_HALF})"),
            "tf32": (756 / 2 * _T, f"TF32 Tensor Core 756 TFLOPS* ({_HALF})"),
            "fp32": (51 * _T, "FP32 51 TFLOPS"),
        },
        "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 PCIe column",
    ),
    *_rows(
        ("H200 !NVL",),
        _H100_SXM,
        "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column",
    ),
    *_rows(
        ("B200",),
        {
            "bf16": (4.5 / 2 * _P, f"FP16/BF16 Tensor Core 4.5 PFLOPS ({_HALF})"),
            "fp16": (4.5 / 2 * _P, f"FP16/BF16 Tensor Core 4.5 PFLOPS ({_HALF})"),
            "fp8": (9 / 2 * _P, f"FP8/FP6 Tensor Core 9 PFLOPS ({_HALF})"),
            "tf32": (2.2 / 2 * _P, f"TF32 Tensor Core 2.2 PFLOPS ({_HALF})"),
            "fp32": (75 * _T, "FP32 75 TFLOPS"),
        },
        "NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx), per-GPU column, preliminary",
    ),
    *_rows(
        ("GB200",),
        {
            "bf16": (5 / 2 * _P, f"FP16/BF16 Tensor Core 5 PFLOPS ({_HALF})"),
            "fp16": (5 / 2 * _P, f"FP16/BF16 Tensor Core 5 PFLOPS ({_HALF})"),
            "fp8": (10 / 2 * _P, f"FP8/FP6 Tensor Core 10 PFLOPS ({_HALF})"),
            "tf32": (2.5 / 2 * _P, f"TF32 Tensor Core 2.5 PFLOPS ({_HALF})"),
            "fp32": (80 * _T, "FP32 80 TFLOPS"),
        },
        "NVIDIA GB200 NVL72 specifications (nvidia.com/en-us/data-center/gb200-nvl72), per-GPU column, preliminary",
    ),
    *_rows(
        ("A100",),
        {
            "bf16": (312 * _T, "BFLOAT16 Tensor Core 312 TFLOPS (624* with sparsity)"),
            "fp16": (312 * _T, "FP16 Tensor Core 312 TFLOPS (624* with sparsity)"),
            "tf32": (156 * _T, "Tensor Float 32 (TF32) 156 TFLOPS (312* with sparsity)"),
            "fp32": (19.5 * _T, "FP32 19.5 TFLOPS"),
        },
        "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
        "A100 80GB PCIe and SXM columns (the 40GB PCIe and SXM4 parts print the same figures)",
    ),
    *_rows(
        ("L40S",),
        {
            "bf16": (362.05 * _T, "BFLOAT16 Tensor Core 362.05 TFLOPS (733* with sparsity)"),
            "fp16": (362.05 * _T, "FP16 Tensor Core 362.05 TFLOPS (733* with sparsity)"),
            "fp8": (733 * _T, "FP8 Tensor Core 733 TFLOPS (1,466* with sparsity)"),
            "tf32": (183 * _T, "TF32 Tensor Core 183 TFLOPS (366* with sparsity)"),
            "fp32": (91.6 * _T, "FP32 91.6 TFLOPS"),
        },
        "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s)",
    ),
    *_rows(
        ("L4",),
        {
            "bf16": (242 / 2 * _T, f"BFLOAT16 Tensor Core 242 TFLOPS* ({_HALF})"),
            "fp16": (242 / 2 * _T, f"FP16 Tensor Core 242 TFLOPS* ({_HALF})"),
            "fp8": (485 / 2 * _T, f"FP8 Tensor Core 485 TFLOPS* ({_HALF})"),
            "tf32": (120 / 2 * _T, f"TF32 Tensor Core 120 TFLOPS* ({_HALF})"),
            "fp32": (30.3 * _T, "FP32 30.3 TFLOPS"),
        },
        "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4)",
    ),
    *_rows(
        ("MI300X",),
        _MI300,
        "AMD Instinct MI300X specifications (amd.com/en/products/accelerators/instinct/mi300/mi300x)",
    ),
    *_rows(
        ("MI325X",),
        _MI300,
        "AMD Instinct MI325X specifications (amd.com/en/products/accelerators/instinct/mi300/mi325x)",
    ),
)


def _pattern_tokens(pattern: str) -> tuple[str, ...]:
    """A pattern's lower-case alphanumeric tokens; a ``!``-prefixed one must be absent from the name."""
    return tuple(re.findall(r"!?[0-9a-z]+", pattern.lower()))


def _matches(pattern: str, name_tokens: frozenset[str]) -> bool:
    """All plain tokens of ``pattern`` are in the name, none of its ``!`` tokens, and ``mig`` only
    when the pattern names it."""
    tokens = _pattern_tokens(pattern)
    wanted = {t for t in tokens if not t.startswith("!")}
    barred = {t[1:] for t in tokens if t.startswith("!")} | ({"mig"} - wanted)
    return wanted <= name_tokens and not barred & name_tokens


def _best(name: str, column: str, table: tuple[PeakEntry, ...]) -> PeakEntry | None:
    """The most specific entry of ``column`` whose pattern matches ``name`` (later wins ties)."""
    name_tokens = frozenset(re.findall(r"[0-9a-z]+", name.lower()))
    found = [e for e in table if e.dtype == column and _matches(e.pattern, name_tokens)]
    return max(reversed(found), key=lambda e: len(_pattern_tokens(e.pattern)), default=None)


def _tf32_enabled() -> bool:
    """Whether float32 CUDA matmuls may run as TF32 (new and legacy switches alike, see module doc)."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def _column(dtype: torch.dtype, tf32: bool) -> str | None:
    """The table column a dtype computes in: float32 is ``"tf32"`` or ``"fp32"``; None when none."""
    if dtype == torch.float32:
        return "tf32" if tf32 else "fp32"
    return _COLUMN_OF.get(dtype)


def _device_name(device: torch.device | str | None) -> tuple[str | None, str]:
    """``(name, "")`` for a CUDA/ROCm device or a device name, or ``(None, reason)``."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:  # not "cuda:0"-like: a name such as "NVIDIA H100 80GB HBM3"
            return device, ""
    if device.type != "cuda":
        return None, f"device {device} has no peak FLOP/s table entry; {_ASK}"
    if not torch.cuda.is_available():
        return None, f"device {device} is not available here (torch.cuda.is_available() is False); {_ASK}"
    return torch.cuda.get_device_name(device), ""


def lookup_peak(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16, *, tf32: bool | None = None
) -> tuple[float | None, str]:
    """Dense peak FLOP/s of ``device`` in ``dtype``: ``(flops_per_second, source)`` or ``(None, reason)``.

    ``device``: ``None`` (the current CUDA device, else CPU), a ``torch.device``, a device string
    (``"cuda:1"``) or a device name as ``torch.cuda.get_device_name()`` reports it. For
    ``torch.float32``, ``tf32`` picks the TF32 tensor-core column (``True``) or plain FP32
    (``False``); ``None`` reads ``torch.backends.cuda.matmul.fp32_precision``. See the module doc
    for the table, the matching rules and the sources.
    """
    column = _column(dtype, _tf32_enabled() if tf32 is None else tf32)
    if column is None:
        return None, f"no peak FLOP/s column for {dtype} (the table has bfloat16, float16, float8, float32); {_ASK}"
    name, reason = _device_name(device)
    if name is None:
        return None, reason
    entry = _best(name, column, PEAKS)
    if entry is None:
        label = str(dtype).removeprefix("torch.") + (" with TF32 matmuls" if column == "tf32" else "")
        return None, f"no peak known for {name!r} in {label}; {_ASK}"
    return entry.flops, f"{entry.source} [entry {entry.pattern!r} for {name!r}]"


def register_peak(name_pattern: str, dtype: torch.dtype | str, flops_per_second: float, source: str) -> PeakEntry:
    """Add ``name_pattern``'s peak in ``dtype`` to :data:`PEAKS`, replacing an entry with the same
    pattern tokens and column. Returns the new entry.

    ``dtype`` is a torch dtype (``torch.float32`` means plain FP32) or a column name of
    :data:`COLUMNS` (``"tf32"`` for the TF32 tensor-core peak). The pattern follows the module doc's
    matching rules; a registered entry wins ties with the built-in ones. This rebinds
    ``fxflops.peaks.PEAKS``: read the table as ``peaks.PEAKS``, not through a ``from`` import.
    """
    global PEAKS
    if isinstance(dtype, torch.dtype):
        column = _column(dtype, tf32=False)
    else:
        column = dtype if dtype in COLUMNS else None
    if column is None:
        raise ValueError(f"register_peak: dtype {dtype!r} is neither a dtype of the table nor one of {COLUMNS}")
    tokens = sorted(_pattern_tokens(name_pattern))
    if all(t.startswith("!") for t in tokens):
        raise ValueError(f"register_peak: pattern {name_pattern!r} has no token to match a device name by")
    if not (math.isfinite(flops_per_second) and flops_per_second > 0):
        raise ValueError(f"register_peak: flops_per_second must be positive and finite, got {flops_per_second!r}")
    entry = PeakEntry(name_pattern, column, float(flops_per_second), source)
    kept = (e for e in PEAKS if not (e.dtype == column and sorted(_pattern_tokens(e.pattern)) == tokens))
    PEAKS = (*kept, entry)
    return entry
