"""Every run-wide decision, made once per process from the validated config: where the run computes,
the precision it trains in (``precision=auto`` resolved), whether blocks are compiled,
and the model transforms the strategy applies (FP8 with or without the routed experts, recompute,
compile). The module, the trainer, the callbacks and ``resolved_config.yaml`` all read this one
frozen plan instead of deciding again from the config.

``run_plan(cfg)`` returns the same object for the same config object; a config built again (a
post-training stage that samples on a different layout) gets its own plan.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from dsl_lit.config import TrainConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.parallel.model_transforms import TransformPlan
from dsl_lit.precision.auto import resolve_precision


@dataclass(frozen=True)
class RunPlan:
    device_type: str
    """Where autocast and the model run: ``cuda`` or ``cpu``."""
    precision: PrecisionConfig
    """``cfg.precision`` with ``auto`` resolved to what this machine runs faster."""
    transforms: TransformPlan
    """What the strategy applies to the built model besides its layout (compile resolved, FP8 of
    the routed experts decided by the layout)."""

    @property
    def compile(self) -> bool:
        return self.transforms.compile


_PLANS: dict[int, tuple[weakref.ref, RunPlan]] = {}


def run_plan(cfg: TrainConfig) -> RunPlan:
    """The plan of ``cfg`` (validated), decided on the first call for this config object."""
    cached = _PLANS.get(id(cfg))
    if cached is not None and cached[0]() is cfg:
        return cached[1]
    device_type = _device_type(cfg)
    precision = resolve_precision(cfg.precision, device_type)
    transforms = TransformPlan.of(precision, cfg.memory, compile=compiles(cfg),
                                  compile_backend=cfg.trainer.compile_backend,
                                  expert_parallel=cfg.layout is not None and cfg.layout.ep > 1)
    plan = RunPlan(device_type, precision, transforms)
    key = id(cfg)
    _PLANS[key] = (weakref.ref(cfg, lambda _: _PLANS.pop(key, None)), plan)
    return plan


def _device_type(cfg: TrainConfig) -> str:
    accelerator = cfg.trainer.accelerator
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator in ("gpu", "cuda") else "cpu"


def compiles(cfg: TrainConfig) -> bool:
    """``trainer.compile``, its default (null) resolved: on when training on CUDA without tensor
    parallelism (which compiled blocks do not support yet: ``TrainConfig.validate``)."""
    if cfg.trainer.compile is not None:
        return cfg.trainer.compile
    return _device_type(cfg) == "cuda" and (cfg.layout is None or cfg.layout.tp == 1)
