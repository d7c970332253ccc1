"""Optimizers and learning-rate schedules (their configs are data in ``dsl_lit.config.optim``)."""

from dsl_lit.optim.adamw import param_groups
from dsl_lit.optim.build import build_optimizer
from dsl_lit.optim.schedules import build_lr_scheduler

__all__ = ["build_lr_scheduler", "build_optimizer", "param_groups"]
