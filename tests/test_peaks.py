"""fxflops.peaks: dense peak FLOP/s by device name and dtype, unknowns as (None, reason).

The expected figures are typed here from the vendor datasheets, independently of the table object:
NVIDIA prints H100/H200/B200/GB200/L4 tensor-core figures "with sparsity" (halved here), A100 and
L40S print dense figures, AMD prints dense figures.
"""

from __future__ import annotations

import pytest
import torch

from fxflops import peaks
from fxflops.peaks import PEAKS, PeakEntry, lookup_peak, register_peak

TF, PF = 1e12, 1e15
BF16, FP16, FP8, FP32 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32

DATASHEET = [
    # (name as torch.cuda.get_device_name() reports it, dtype, tf32, dense FLOP/s)
    ("NVIDIA H100 80GB HBM3", BF16, False, 1979 * TF / 2),
    ("NVIDIA H100 80GB HBM3", FP16, False, 1979 * TF / 2),
    ("NVIDIA H100 80GB HBM3", FP8, False, 3958 * TF / 2),
    ("NVIDIA H100 80GB HBM3", torch.float8_e5m2, False, 3958 * TF / 2),
    ("NVIDIA H100 80GB HBM3", FP32, True, 989 * TF / 2),
    ("NVIDIA H100 80GB HBM3", FP32, False, 67 * TF),
    ("NVIDIA H100 PCIe", BF16, False, 1513 * TF / 2),
    ("NVIDIA H100 PCIe", FP8, False, 3026 * TF / 2),
    ("NVIDIA H100 PCIe", FP32, True, 756 * TF / 2),
    ("NVIDIA H100 PCIe", FP32, False, 51 * TF),
    ("NVIDIA H200", BF16, False, 1979 * TF / 2),
    ("NVIDIA H200", FP8, False, 3958 * TF / 2),
    ("NVIDIA B200", BF16, False, 4.5 * PF / 2),
    ("NVIDIA B200", FP8, False, 9 * PF / 2),
    ("NVIDIA B200", FP32, True, 2.2 * PF / 2),
    ("NVIDIA GB200", BF16, False, 5 * PF / 2),
    ("NVIDIA GB200", FP8, False, 10 * PF / 2),
    ("NVIDIA A100-SXM4-80GB", BF16, False, 312 * TF),
    ("NVIDIA A100-SXM4-40GB", FP16, False, 312 * TF),
    ("NVIDIA A100-PCIE-40GB", BF16, False, 312 * TF),
    ("NVIDIA A100 80GB PCIe", FP32, True, 156 * TF),
    ("NVIDIA A100-SXM4-80GB", FP32, False, 19.5 * TF),
    ("NVIDIA L40S", BF16, False, 362.05 * TF),
    ("NVIDIA L40S", FP8, False, 733 * TF),
    ("NVIDIA L40S", FP32, False, 91.6 * TF),
    ("NVIDIA L4", BF16, False, 242 * TF / 2),
    ("NVIDIA L4", FP8, False, 485 * TF / 2),
    ("NVIDIA L4", FP32, True, 120 * TF / 2),
    ("AMD Instinct MI300X", BF16, False, 1307.4 * TF),
    ("AMD Instinct MI300X", torch.float8_e4m3fnuz, False, 2614.9 * TF),
    ("AMD Instinct MI300X", FP32, False, 163.4 * TF),
    ("AMD Instinct MI325X", FP16, False, 1307.4 * TF),
]


@pytest.mark.parametrize("name,dtype,tf32,expected", DATASHEET)
def test_device_names_give_the_datasheet_figures(name, dtype, tf32, expected):
    flops, source = lookup_peak(name, dtype, tf32=tf32)
    assert flops == pytest.approx(expected, rel=1e-12)
    assert source  # names the datasheet


def test_sources_say_when_a_sparse_figure_was_halved():
    _, h100 = lookup_peak("NVIDIA H100 80GB HBM3", BF16)
    assert "1,979" in h100 and "sparsity" in h100 and "halved" in h100
    _, a100 = lookup_peak("NVIDIA A100-SXM4-80GB", BF16)
    assert "312" in a100 and "halved" not in a100


def test_most_specific_pattern_wins():
    sxm, _ = lookup_peak("NVIDIA H100 80GB HBM3", BF16)
    pcie, _ = lookup_peak("NVIDIA H100 PCIe", BF16)
    assert (sxm, pcie) == (1979 * TF / 2, 1513 * TF / 2)
    # whole tokens: L4 is not a prefix match of L40S, A100 not of A100X
    assert lookup_peak("NVIDIA L40S", BF16)[0] == pytest.approx(362.05 * TF)
    assert lookup_peak("NVIDIA A100X", BF16)[0] is None


def test_a_generic_registration_does_not_override_specific_entries(monkeypatch):
    monkeypatch.setattr(peaks, "PEAKS", PEAKS)  # restored after the test
    register_peak("H100", BF16, 1.0, "generic test entry")
    assert lookup_peak("NVIDIA H100 PCIe", BF16)[0] == 1513 * TF / 2  # two tokens beat one
    flops, source = lookup_peak("NVIDIA H100 NVL", BF16)  # nothing more specific: the generic one
    assert flops == 1.0 and "generic test entry" in source


def test_variants_without_a_confirmed_figure_are_unknown_not_their_siblings():
    for name in ("NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA H100", "NVIDIA A10G", "AMD Instinct MI250X / MI250"):
        flops, reason = lookup_peak(name, BF16)
        assert flops is None and name in reason and "peak_flops" in reason


def test_mig_slices_do_not_get_the_whole_gpu_peak():
    flops, reason = lookup_peak("NVIDIA A100-SXM4-40GB MIG 3g.20gb", BF16)
    assert flops is None and "MIG 3g.20gb" in reason


def test_unknown_device_name_says_which_and_how_to_fix():
    flops, reason = lookup_peak("NVIDIA GeForce RTX 3090", BF16)
    assert flops is None
    assert reason == "no peak known for 'NVIDIA GeForce RTX 3090' in bfloat16; pass peak_flops=..."


def test_cpu_has_no_peak():
    for device in ("cpu", torch.device("cpu")):
        flops, reason = lookup_peak(device, BF16)
        assert flops is None and "cpu" in reason and "peak_flops" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="None means the current CUDA device there")
def test_none_and_cuda_on_a_cpu_only_machine_have_no_peak():
    for device in (None, "cuda:0", torch.device("cuda")):
        flops, reason = lookup_peak(device, BF16)
        assert flops is None and "peak_flops" in reason


def test_dtype_without_a_column_is_unknown():
    for dtype in (torch.float64, torch.int8):
        flops, reason = lookup_peak("NVIDIA H100 80GB HBM3", dtype)
        assert flops is None and str(dtype) in reason and "peak_flops" in reason


def test_dtype_the_device_lacks_is_unknown():
    assert lookup_peak("NVIDIA A100-SXM4-80GB", FP8)[0] is None  # Ampere has no FP8
    flops, reason = lookup_peak("AMD Instinct MI300X", FP32, tf32=True)  # TF32 on ROCm: not assumed
    assert flops is None and "TF32" in reason


def test_float32_follows_the_tf32_setting():
    """Set with torch's own setters and restored in ``finally``: pytest's monkeypatch cannot undo
    ``fp32_precision`` (torch serves it through ``__getattr__``; pytest 9.2 fails the undo)."""
    name = "NVIDIA H100 80GB HBM3"
    matmul = torch.backends.cuda.matmul
    assert matmul.fp32_precision != "tf32"  # PyTorch's default: full FP32
    assert lookup_peak(name, FP32)[0] == 67 * TF
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        assert lookup_peak(name, FP32)[0] == 989 * TF / 2
        assert lookup_peak(name, FP32, tf32=False)[0] == 67 * TF  # an explicit choice wins
    finally:
        matmul.fp32_precision = before
    assert lookup_peak(name, FP32)[0] == 67 * TF
    torch.set_float32_matmul_precision("high")  # the legacy switch reads the same
    try:
        assert lookup_peak(name, FP32)[0] == 989 * TF / 2
    finally:
        torch.set_float32_matmul_precision("highest")
    assert lookup_peak(name, FP32)[0] == 67 * TF


def test_register_peak_adds_replaces_and_is_undone():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(peaks, "PEAKS", PEAKS)  # restored when the block ends
        entry = register_peak("RTX 3090", BF16, 71 * TF, "GeForce RTX 3090 (test figure)")
        assert isinstance(entry, PeakEntry) and entry in peaks.PEAKS
        flops, source = lookup_peak("NVIDIA GeForce RTX 3090", BF16)
        assert flops == 71 * TF and "GeForce RTX 3090 (test figure)" in source
        register_peak("rtx-3090", "bf16", 70 * TF, "replaced")  # same tokens and column: replaces
        assert lookup_peak("NVIDIA GeForce RTX 3090", BF16)[0] == 70 * TF
        assert len(peaks.PEAKS) == len(PEAKS) + 1
        register_peak("NVIDIA H100", "tf32", 1.0, "override")  # two tokens, as many as "H100 PCIe": a tie
        flops, source = lookup_peak("NVIDIA H100 PCIe", FP32, tf32=True)
        assert flops == 1.0 and "override" in source  # ties go to the registered entry
        assert lookup_peak("NVIDIA H100 PCIe", FP32, tf32=False)[0] == 51 * TF  # other columns untouched
    assert peaks.PEAKS is PEAKS
    assert lookup_peak("NVIDIA GeForce RTX 3090", BF16)[0] is None
    assert lookup_peak("NVIDIA H100 PCIe", FP32, tf32=True)[0] == 756 * TF / 2


@pytest.mark.parametrize(
    "args",
    [
        ("X", torch.float64, 1.0, "s"),  # no column
        ("X", "int8", 1.0, "s"),  # no column
        ("!X", BF16, 1.0, "s"),  # nothing to match by
        ("X", BF16, 0.0, "s"),
        ("X", BF16, float("inf"), "s"),
    ],
)
def test_register_peak_rejects_bad_input(args):
    with pytest.raises(ValueError):
        register_peak(*args)


def test_table_is_consistent():
    assert all(isinstance(e, PeakEntry) and e.dtype in peaks.COLUMNS and e.flops > 0 and e.source for e in PEAKS)
    keys = [(frozenset(peaks._pattern_tokens(e.pattern)), e.dtype) for e in PEAKS]
    assert len(keys) == len(set(keys))  # one figure per pattern and column
