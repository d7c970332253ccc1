"""Optimizers and learning-rate schedules."""

from dsl_lit.optim.adamw import OptimConfig, build_optimizer, param_groups
from dsl_lit.optim.schedules import ScheduleConfig, build_lr_scheduler

__all__ = ["OptimConfig", "ScheduleConfig", "build_lr_scheduler", "build_optimizer", "param_groups"]
