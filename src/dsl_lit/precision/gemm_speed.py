"""How fast this device multiplies matrices in a dtype: the MFU denominator on devices without a
spec sheet, and what ``precision=auto`` decides by."""

from __future__ import annotations

import statistics
import time

import torch


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device | str = "cpu", size: int = 2048,
                          repeats: int = 3) -> float:
    """TFLOP/s of a square GEMM of ``size`` in ``dtype`` on ``device`` (one warm-up, then
    ``repeats`` timed products)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    synchronize = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    a @ b  # warm up the kernel selection
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize()
    seconds = time.perf_counter() - start
    return 2 * size**3 * repeats / seconds / 1e12


def bf16_speedup(device: torch.device | str = "cpu", size: int = 1024, rounds: int = 3) -> float:
    """bf16 GEMM TFLOP/s over fp32 GEMM TFLOP/s on ``device``: the median of ``rounds``
    interleaved pairs, so that a burst of load from elsewhere hits both sides alike."""
    ratios = [measure_matmul_tflops(torch.bfloat16, device, size, 2) / measure_matmul_tflops(torch.float32, device, size, 2)
              for _ in range(rounds)]
    return statistics.median(ratios)
