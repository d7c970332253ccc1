"""``precision=auto``: bf16 autocast where this machine has native bf16 arithmetic, fp32 elsewhere.

CPUs differ by a factor of ten here: with AMX or AVX512-BF16 a bf16 GEMM runs several times the
speed of fp32, without them bf16 is emulated and slower (``benchmarks/precision_auto.py`` measures
both and prints whether the rule below picked the faster one). So the choice follows the
hardware's instruction set, read from torch's CPU/CUDA capability checks, not a start-up timing:
it costs nothing, it is the same on every run of the same machine (a resumed run trains in the
precision it started in, whatever the load on the machine when it resumes), and every rank of
a run derives it for itself with no state passed between processes. Ranks on different hardware
(a mixed cluster) stop before the first step (:func:`check_ranks_agree`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dsl_lit.config.precision import PrecisionConfig

log = logging.getLogger(__name__)

BF16_FASTER_FROM = 1.2
"""The bf16/fp32 GEMM speed ratio from which the benchmark counts bf16 as the faster choice (bf16
costs accuracy, 8 mantissa bits: it must clearly pay)."""

_decided_here: str | None = None
"""The decision this process made (``"bf16 (AMX, AVX512-BF16)"``), for the ranks' check."""


def native_bf16(device_type: str) -> list[str]:
    """What gives this device native bf16 arithmetic (empty where bf16 is emulated)."""
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return [f"compute capability {major}.{minor}"] if major >= 8 else []
    found = [("AMX", torch.cpu._is_amx_tile_supported()), ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported())]
    return [name for name, present in found if present]


def decide(native: list[str]) -> str:
    return "bf16" if native else "fp32"


def resolve_precision(precision: PrecisionConfig, device_type: str) -> PrecisionConfig:
    """``precision`` itself unless its name is ``auto``; then a copy naming what this run uses."""
    global _decided_here
    if precision.name != "auto":
        return precision
    native = native_bf16(device_type)
    name = decide(native)
    why = ", ".join(native) if native else "no native bf16"
    if _decided_here is None:
        log.info("precision=auto: training in %s on this %s (%s)", name, device_type, why)
    _decided_here = f"{name} ({why})"
    return dataclasses.replace(precision, name=name)


def check_ranks_agree() -> None:
    """Ranks on different hardware decide differently: stop, before the first step, if they did
    (their autocast would silently differ). A no-op where ``precision=auto`` was not asked for."""
    import torch.distributed as dist

    if _decided_here is None or not dist.is_available() or not dist.is_initialized():
        return
    decisions: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(decisions, _decided_here)
    if len({d.split()[0] for d in decisions if d}) > 1:
        raise RuntimeError(f"precision=auto decided differently on different ranks (rank: decision): "
                           f"{dict(enumerate(decisions))}; set precision=bf16 or precision=fp32")
