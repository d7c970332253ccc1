"""Learning-rate schedules as multipliers of the peak lr, one pure function per shape.

Each ``*_multiplier(step, ...)`` returns lr(step) / peak_lr for the optimizer step ``step``
(0-based: the value used by the first update is ``multiplier(0)``). ``build_lr_scheduler`` wraps
the chosen one in a ``LambdaLR`` so its state lives in checkpoints like any scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from dsl_lit.errors import ConfigError

ScheduleName = Literal["multi_step", "cosine", "wsd", "constant"]


def _warmup(step: int, warmup_steps: int) -> float:
    """Linear warmup that reaches 1 at step == warmup_steps (step 0 gets 1 / warmup_steps, not 0)."""
    return (step + 1) / warmup_steps if step < warmup_steps else 1.0


def multi_step_multiplier(
    step: int, total_steps: int, warmup_steps: int,
    milestones: tuple[float, ...] = (0.8, 0.9), factors: tuple[float, ...] = (0.316, 0.1),
) -> float:
    """DeepSeek LLM: warmup, then the peak, x0.316 from 80% of training and x0.1 from 90%."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    value = 1.0
    for milestone, factor in zip(milestones, factors):
        if step >= round(milestone * total_steps):
            value = factor
    return value


def cosine_multiplier(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """Warmup, then half a cosine from 1 down to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd_multiplier(
    step: int, total_steps: int, warmup_steps: int, decay_fraction: float = 0.2, min_ratio: float = 0.0,
) -> float:
    """Warmup-stable-decay: warmup, constant peak, then a linear decay over the last ``decay_fraction``."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    decay_start = total_steps - round(decay_fraction * total_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return 1.0 - (1.0 - min_ratio) * progress


def constant_multiplier(step: int, total_steps: int, warmup_steps: int) -> float:
    return _warmup(step, warmup_steps)


def piecewise_constant(progress: float, values: Sequence[float], boundaries: Sequence[float]) -> float:
    """``values[i]`` while ``progress`` (fraction of training, 0..1) is below ``boundaries[i]``;
    used for coefficients that DeepSeek switches at a token count (MTP weight 0.3 -> 0.1 after
    10T of 14.8T tokens, bias update speed 0.001 -> 0 for the last 500B)."""
    for value, boundary in zip(values, boundaries):
        if progress < boundary:
            return value
    return values[len(boundaries)]


def check_piecewise(values: Sequence[float], boundaries: Sequence[float], field: str) -> None:
    """ConfigError unless there is one more value than boundaries and boundaries rise within [0, 1]."""
    if len(values) != len(boundaries) + 1:
        raise ConfigError(
            f"{field} has {len(values)} value(s) and {len(boundaries)} boundary(ies); "
            "a piecewise-constant schedule needs exactly one more value than boundaries"
        )
    if list(boundaries) != sorted(boundaries) or any(not 0.0 <= b <= 1.0 for b in boundaries):
        raise ConfigError(f"{field} boundaries {list(boundaries)} must rise within [0, 1] (fractions of training)")


@dataclass
class ScheduleConfig:
    """The ``schedule`` config group. ``total_steps`` defaults to ``trainer.max_steps``."""

    name: ScheduleName = "multi_step"
    warmup_steps: int = 2000
    total_steps: int | None = None
    milestones: tuple[float, ...] = (0.8, 0.9)
    factors: tuple[float, ...] = (0.316, 0.1)
    min_ratio: float = 0.1
    decay_fraction: float = 0.2

    def validate(self) -> ScheduleConfig:
        if self.name not in _SCHEDULES:
            raise ConfigError(f"schedule.name={self.name!r} is unknown; choose one of {sorted(_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps={self.warmup_steps} must be >= 0")
        if self.total_steps is not None and self.total_steps <= 0:
            raise ConfigError(f"schedule.total_steps={self.total_steps} must be > 0 (or null for trainer.max_steps)")
        if len(self.milestones) != len(self.factors) or list(self.milestones) != sorted(self.milestones):
            raise ConfigError("schedule.milestones must be increasing and as many as schedule.factors")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ConfigError(f"schedule.min_ratio={self.min_ratio} must lie in [0, 1]")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"schedule.decay_fraction={self.decay_fraction} must lie in [0, 1]")
        return self

    def multiplier(self, total_steps: int):
        """The step -> multiplier function for this config (picklable, so schedulers checkpoint)."""
        total = self.total_steps or total_steps
        common = dict(total_steps=total, warmup_steps=self.warmup_steps)
        if self.name == "multi_step":
            return partial(multi_step_multiplier, **common, milestones=tuple(self.milestones),
                           factors=tuple(self.factors))
        if self.name == "cosine":
            return partial(cosine_multiplier, **common, min_ratio=self.min_ratio)
        if self.name == "wsd":
            return partial(wsd_multiplier, **common, decay_fraction=self.decay_fraction, min_ratio=self.min_ratio)
        return partial(constant_multiplier, **common)


_SCHEDULES = {"multi_step", "cosine", "wsd", "constant"}


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, cfg.multiplier(total_steps))
