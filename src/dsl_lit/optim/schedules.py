"""Learning-rate schedules as multipliers of the peak lr, one pure function per shape.

Each ``*_multiplier(step, ...)`` returns lr(step) / peak_lr for the optimizer step ``step``
(0-based: the value used by the first update is ``multiplier(0)``). ``build_lr_scheduler`` wraps
the chosen one in a ``LambdaLR`` so its state lives in checkpoints like any scheduler.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from dsl_lit.config.data import BatchSchedule
from dsl_lit.config.optim import ScheduleConfig


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


def deepseek_v3_multiplier(
    step: int, warmup_steps: int, batches: BatchSchedule, stable_tokens: float, decay_tokens: float,
    min_ratio: float, tail_tokens: float, tail_ratio: float,
) -> float:
    """DeepSeek-V3 (section 4.2), in tokens: linear warmup over ``warmup_steps`` steps, the peak
    until ``stable_tokens``, a cosine to ``min_ratio`` over ``decay_tokens``, ``min_ratio`` for
    ``tail_tokens`` more, then ``tail_ratio``. Tokens follow the batch ramp."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    tokens = batches.advance(0, step) * batches.seq_len  # trained before this step
    if tokens < stable_tokens:
        return 1.0
    if tokens < stable_tokens + decay_tokens:
        progress = (tokens - stable_tokens) / decay_tokens
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio if tokens < stable_tokens + decay_tokens + tail_tokens else tail_ratio


def schedule_multiplier(cfg: ScheduleConfig, total_steps: int, batches: BatchSchedule | None = None):
    """The step -> multiplier function for this config (picklable, so schedulers checkpoint)."""
    total = cfg.total_steps or total_steps
    common = dict(total_steps=total, warmup_steps=cfg.warmup_steps)
    if cfg.name == "multi_step":
        return partial(multi_step_multiplier, **common, milestones=tuple(cfg.milestones),
                       factors=tuple(cfg.factors))
    if cfg.name == "cosine":
        return partial(cosine_multiplier, **common, min_ratio=cfg.min_ratio)
    if cfg.name == "wsd":
        return partial(wsd_multiplier, **common, decay_fraction=cfg.decay_fraction, min_ratio=cfg.min_ratio)
    if cfg.name == "deepseek_v3_tokens":
        if batches is None:
            raise ValueError("schedule.name=deepseek_v3_tokens counts tokens: pass the run's batch schedule")
        return partial(deepseek_v3_multiplier, warmup_steps=cfg.warmup_steps, batches=batches,
                       stable_tokens=cfg.stable_tokens, decay_tokens=cfg.decay_tokens, min_ratio=cfg.min_ratio,
                       tail_tokens=cfg.tail_tokens, tail_ratio=cfg.tail_ratio)
    return partial(constant_multiplier, **common)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int, batches: BatchSchedule | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_multiplier(cfg, total_steps, batches))
