"""``precision=auto``: bf16 autocast where this machine multiplies bf16 faster, fp32 elsewhere.

CPUs differ by a factor of ten here: with AMX or AVX512-BF16 a bf16 GEMM runs several times the
speed of fp32, without them bf16 is emulated and slower. So the choice is measured at start-up
(a GEMM in each dtype, :func:`~dsl_lit.precision.gemm_speed.bf16_speedup`), logged with the ratio,
and made once per run: the launching process records it in ``DSL_LIT_PRECISION_AUTO``, which the
ranks Lightning starts inherit, and the strategy checks that ranks started by torchrun or SLURM
(each measuring for itself) agree before the first step.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.precision.gemm_speed import bf16_speedup

log = logging.getLogger(__name__)

DECISION_VARIABLE = "DSL_LIT_PRECISION_AUTO"
"""``"<name> <measured bf16/fp32 ratio>"``, set by the process that decided."""
BF16_MIN_SPEEDUP = 1.2
"""bf16 costs accuracy (8 mantissa bits); take it only where it clearly pays."""


def decide(speedup: float) -> str:
    return "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"


def resolve_precision(precision: PrecisionConfig, device_type: str) -> PrecisionConfig:
    """``precision`` itself unless its name is ``auto``; then a copy naming what this run uses."""
    if precision.name != "auto":
        return precision
    recorded = os.environ.get(DECISION_VARIABLE)
    if recorded:
        name, speedup = recorded.split()[0], float(recorded.split()[1])
    else:
        speedup = bf16_speedup(device_type)
        name = decide(speedup)
        os.environ[DECISION_VARIABLE] = f"{name} {speedup:.3f}"
        log.info("precision=auto: a bf16 GEMM runs at %.2fx the speed of fp32 on this %s (bf16 from %.1fx): "
                 "training in %s", speedup, device_type, BF16_MIN_SPEEDUP, name)
    return dataclasses.replace(precision, name=name)


def check_ranks_agree() -> None:
    """Ranks started by torchrun or SLURM measured for themselves: stop, before the first step, if
    they decided differently (their autocast would silently differ)."""
    import torch.distributed as dist

    recorded = os.environ.get(DECISION_VARIABLE)
    if recorded is None or not dist.is_available() or not dist.is_initialized():
        return
    decisions: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(decisions, recorded)
    if len({d.split()[0] for d in decisions}) > 1:
        raise RuntimeError(f"precision=auto decided differently on different ranks (rank: decision, bf16/fp32 "
                           f"speed-up): {dict(enumerate(decisions))}; set precision=bf16 or precision=fp32")
