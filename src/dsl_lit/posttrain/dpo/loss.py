"""Direct Preference Optimization (Rafailov et al. 2023) and the variants TRL names the same way.

With ``h = (pi_c - pi_r) - (ref_c - ref_r)`` (log-prob differences of the chosen and rejected
completions under the policy and the reference):

- ``sigmoid`` (DPO, with conservative label smoothing eps): ``-(1-eps) log s(beta h) - eps log s(-beta h)``
- ``robust`` (Chowdhury et al. 2024, unbiased under label noise eps):
  ``(-(1-eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)``
- ``hinge`` (SLiC): ``relu(1 - beta h)``
- ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``; pass length-averaged log-probs, as IPO does.

The implicit rewards ``beta (pi - ref)`` of each completion come back too (DPO's margin metric).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dsl_lit.config.posttrain import DPO_LOSS_TYPES


class DPOOutput(NamedTuple):
    losses: torch.Tensor
    """[pairs] loss of each pair (take the mean for the batch loss)."""
    chosen_rewards: torch.Tensor
    """[pairs] ``beta (pi_c - ref_c)``, detached."""
    rejected_rewards: torch.Tensor
    """[pairs] ``beta (pi_r - ref_r)``, detached."""


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOOutput:
    """Per-pair DPO losses and implicit rewards from per-sequence log-probabilities [pairs]."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is unknown; choose one of {DPO_LOSS_TYPES}")
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 0.5)")
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - eps) - F.logsigmoid(-beta * h) * eps
    elif loss_type == "robust":
        losses = (-F.logsigmoid(beta * h) * (1 - eps) + F.logsigmoid(-beta * h) * eps) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:  # ipo
        losses = (h - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return DPOOutput(losses, chosen_rewards, rejected_rewards)
