"""Resumed with other optimizer or schedule settings, a run trains with them from the resumed step.

A checkpoint stores each optimizer param group's hyperparameters (``lr``, ``betas``, ``eps``,
``weight_decay``, ...) and the scheduler's ``base_lrs``; restoring them as saved would keep the old
values silently while the config (and ``resolved_config.yaml``) says otherwise. The run has just
built its optimizer and scheduler from its own config, so before Lightning restores from the
checkpoint, their hyperparameters are written into it: what stays the checkpoint's is the state
(AdamW's moments and step counts, the scheduler's position). The learning rate of the resumed step
is the new schedule's at that step (``base_lr * multiplier(step)``, what ``LambdaLR`` computes,
bit for bit the saved value when nothing changed). Which settings may change is decided at start-up
(:mod:`dsl_lit.checkpoint.config_drift`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR


def use_current_hyperparameters(
    checkpoint: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any],
) -> None:
    """Rewrite ``checkpoint``'s optimizer param groups and ``LambdaLR`` scheduler states (in place)
    with the hyperparameters of this run's ``optimizers`` and ``schedulers`` (Lightning's
    ``LRSchedulerConfig`` objects). Our schedules are all ``LambdaLR`` (``build_lr_scheduler``)."""
    saved_optimizers = checkpoint.get("optimizer_states") or []
    for saved, optimizer in zip(saved_optimizers, optimizers):
        for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
            saved_group.update({k: v for k, v in group.items() if k != "params"})
    for saved, config in zip(checkpoint.get("lr_schedulers") or [], schedulers):
        scheduler = config.scheduler
        if not isinstance(scheduler, LambdaLR):
            continue
        step = saved["last_epoch"]
        lrs = [base * multiplier(step) for base, multiplier in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        # lr_lambdas None: the multipliers are this run's (built from its schedule config), not the saved ones
        saved.update(base_lrs=list(scheduler.base_lrs), _last_lr=lrs, lr_lambdas=[None] * len(lrs))
        index = next((i for i, o in enumerate(optimizers) if o is scheduler.optimizer), len(saved_optimizers))
        if index < len(saved_optimizers):
            for saved_group, lr in zip(saved_optimizers[index]["param_groups"], lrs):
                saved_group["lr"] = lr
