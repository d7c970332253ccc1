"""How fast this device multiplies matrices in a dtype: the MFU denominator on devices without a
spec sheet, and the bf16/fp32 ratio ``benchmarks/precision_auto.py`` checks ``precision=auto``'s
rule against.

Both measurements are bounded in time, not in size: on a CPU without native bf16 a bf16 GEMM runs
through a slow fallback (a 2048^3 product took 90 s on a 2-core AMD EPYC without AVX512-BF16), so
the square grows from ``START_SIZE`` only while the next size's products fit the time budget.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

START_SIZE = 256
BUDGET_S = 1.0
"""Seconds the timed products of one measurement may take, roughly (warm-ups not counted)."""


def _seconds_per_product(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    synchronize = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    a @ b  # warm up the kernel selection
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize()
    return (time.perf_counter() - start) / repeats


def _seconds_at(dtypes: Sequence[torch.dtype], device: torch.device | str, size: int, repeats: int) -> list[float]:
    """Seconds per square product of ``size`` in each of ``dtypes``, one after the other."""
    operands = [(torch.randn(size, size, device=device).to(d), torch.randn(size, size, device=device).to(d))
                for d in dtypes]
    return [_seconds_per_product(a, b, repeats) for a, b in operands]


def _timed_square(dtypes: Sequence[torch.dtype], device: torch.device | str, max_size: int, repeats: int,
                  budget_s: float) -> tuple[int, list[float]]:
    """(size, seconds per product of each dtype) at the largest power-of-two size <= ``max_size``
    whose products fit ``budget_s`` (a size costs 8x the previous one)."""
    size = min(START_SIZE, max_size)
    while True:
        seconds = _seconds_at(dtypes, device, size, repeats)
        if 2 * size > max_size or 8 * sum(seconds) * repeats > budget_s:
            return size, seconds
        size *= 2


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device | str = "cpu", size: int = 2048,
                          repeats: int = 3, budget_s: float = BUDGET_S) -> float:
    """TFLOP/s of a square GEMM in ``dtype`` on ``device``: ``repeats`` timed products after a
    warm-up, of the largest size up to ``size`` that fits ``budget_s``."""
    n, (seconds,) = _timed_square([dtype], device, size, repeats, budget_s)
    return 2 * n**3 / seconds / 1e12


def bf16_speedup(device: torch.device | str = "cpu", size: int = 1024, rounds: int = 3,
                 budget_s: float = BUDGET_S) -> float:
    """bf16 GEMM TFLOP/s over fp32 GEMM TFLOP/s on ``device``, both at one size (chosen within the
    budget): the median of ``rounds`` interleaved pairs, so that a burst of load from elsewhere
    hits both sides alike."""
    n, (bf16, fp32) = _timed_square([torch.bfloat16, torch.float32], device, size, 2, budget_s)
    ratios = [fp32 / bf16]
    for _ in range(rounds - 1):
        bf16, fp32 = _seconds_at([torch.bfloat16, torch.float32], device, n, 2)
        ratios.append(fp32 / bf16)
    return statistics.median(ratios)
