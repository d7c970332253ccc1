"""MFU's denominator is the peak of the precision the matmuls actually run in (issue 21): bf16 and
fp16 autocast against their tensor-core peak, fp32 against TF32 where CUDA allows it and true
fp32 elsewhere; a measured peak times a GEMM in that dtype on the training device."""

from __future__ import annotations

import pytest
import torch

from dsl_lit.precision.gemm_speed import measure_matmul_tflops
from dsl_lit.training.callbacks.throughput import gemm_precision, spec_sheet_peak

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def matmul_precision():
    previous = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(previous)


def test_the_precision_matmuls_run_in(matmul_precision) -> None:
    assert gemm_precision("bf16", CPU) == "bf16" and gemm_precision("fp16", CUDA) == "fp16"
    assert gemm_precision("fp32", CPU) == "fp32"  # no TF32 on CPUs
    matmul_precision("high")
    assert gemm_precision("fp32", CUDA) == "tf32"
    matmul_precision("highest")
    assert gemm_precision("fp32", CUDA) == "fp32"


def test_spec_sheet_peaks() -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    assert spec_sheet_peak(h100, "bf16") == spec_sheet_peak(h100, "fp16") == 989.0
    assert spec_sheet_peak(h100, "tf32") == 494.0 and spec_sheet_peak(h100, "fp32") == 67.0
    assert spec_sheet_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert spec_sheet_peak("NVIDIA GeForce RTX 4090", "bf16") is None  # measured instead


def test_measured_peak_is_positive_in_each_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert measure_matmul_tflops(dtype, CPU, size=128, repeats=2) > 0
