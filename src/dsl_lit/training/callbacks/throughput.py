"""Tokens/s, tokens seen and MFU, logged every optimizer step."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import torch

from dsl_lit.parallel.step_runner import step_runner_of
from dsl_lit.precision.gemm_speed import measure_matmul_tflops

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU (no sparsity) of the GEMMs training runs: bf16 and fp16 tensor cores
# (autocast), TF32 tensor cores (fp32 matmuls while TF32 is allowed) and plain fp32 (CUDA cores,
# torch.set_float32_matmul_precision("highest")). SXM parts. FP8 recipes count against the bf16 peak
# (attention and the GEMMs they leave out run bf16), the conservative choice.
_GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H800": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
_GEMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}


def gemm_precision(precision: str, device: torch.device) -> str:
    """The precision the step's matmuls actually run in: bf16/fp16 under autocast; fp32 training
    runs TF32 on CUDA when ``torch.get_float32_matmul_precision()`` allows it, else true fp32."""
    if precision in ("bf16", "fp16"):
        return precision
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def spec_sheet_peak(device_name: str, kind: str) -> float | None:
    """Dense peak TFLOP/s of ``kind`` (:func:`gemm_precision`) for a GPU the table knows, else None."""
    for key, table in _GPU_PEAK_TFLOPS.items():
        if key in device_name:
            return table[kind]
    return None


def peak_tflops(device: torch.device, precision: str) -> float:
    """Per-device peak TFLOP/s of the precision the matmuls run in (:func:`gemm_precision`): the
    spec sheet on known GPUs, else a GEMM measured on ``device`` in that dtype (logged)."""
    kind = gemm_precision(precision, device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        value = spec_sheet_peak(name, kind)
        if value is not None:
            log.info("MFU denominator: %s peak of %s, %.1f TFLOP/s", kind, name, value)
            return value
        log.warning("no peak FLOP/s on file for %s; MFU uses a measured GEMM peak instead", name)
    value = measure_matmul_tflops(_GEMM_DTYPES[kind], device)
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
        pl_module.log_step("perf/tokens_per_s", tokens_per_s, prog_bar=True)
        pl_module.log_step("perf/step_time_s", seconds)
        pl_module.log_step("perf/tokens_seen", float(pl_module.tokens_seen))
        pl_module.log_step("perf/mfu", mfu)
