"""Tokens/s, tokens seen and MFU, logged every optimizer step."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import torch

from dsl_lit.parallel.step_runner import step_runner_of

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU (no sparsity) for bf16 and fp32 (TF32 tensor cores) training.
_GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp32": 494.0},
    "H800": {"bf16": 989.0, "fp32": 494.0},
    "H200": {"bf16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "A800": {"bf16": 312.0, "fp32": 156.0},
}


def measure_matmul_tflops(dtype: torch.dtype, size: int = 2048, repeats: int = 3) -> float:
    """Peak for devices without a table entry (CPUs): time a square GEMM in the training dtype."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm up the kernel selection
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    seconds = time.perf_counter() - start
    return 2 * size**3 * repeats / seconds / 1e12


def peak_tflops(device: torch.device, precision: str) -> float:
    """Per-device peak TFLOP/s: the spec sheet on known GPUs, else a measured GEMM (logged)."""
    kind = "bf16" if precision == "bf16" else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return table[kind]
        log.warning("no peak FLOP/s on file for %s; MFU uses a measured GEMM peak instead", name)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    value = measure_matmul_tflops(dtype)
    log.info("MFU denominator: measured %.3f TFLOP/s for a %s GEMM on %s", value, kind, device.type)
    return value


class ThroughputMonitor(L.Callback):
    """Times each optimizer step and logs ``perf/tokens_per_s``, ``perf/tokens_seen``, ``perf/mfu``.

    ``flops_per_token`` is the analytical training count; MFU = achieved / (peak x world size).
    """

    def __init__(self, flops_per_token: float, precision: str, peak: float | None = None) -> None:
        self.flops_per_token = flops_per_token
        self.precision = precision
        self.peak = peak
        self._start = 0.0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak is None:
            self.peak = peak_tflops(pl_module.device, self.precision)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._start
        tokens = pl_module.tokens_in_batch(batch) * step_runner_of(trainer.strategy).dp_size  # tp ranks share data
        tokens_per_s = tokens / seconds
        mfu = tokens_per_s * self.flops_per_token / (self.peak * 1e12 * trainer.world_size)
        pl_module.log("perf/tokens_per_s", tokens_per_s, prog_bar=True)
        pl_module.log_dict({
            "perf/step_time_s": seconds,
            "perf/tokens_seen": float(pl_module.tokens_seen),
            "perf/mfu": mfu,
        })
