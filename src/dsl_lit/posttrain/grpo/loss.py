"""Group Relative Policy Optimization (DeepSeekMath, DeepSeek-R1): group advantages and the loss.

For G completions of one prompt with rewards r_i, the advantage of every token of completion i is
``A_i = (r_i - mean(r)) / (std(r) + 1e-4)`` (unbiased std, TRL's convention). The per-token loss is
PPO's clipped surrogate plus a KL penalty to a reference policy with the k3 estimator
(Schulman 2020), which is unbiased and always >= 0:

    ratio = exp(logp - old_logp)
    loss_t = -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) + beta (exp(d) - d - 1),  d = ref_logp - logp

Two variants of the surrogate, both TRL's (``tests/unit/posttrain/test_grpo_trl_reference.py``):

- GSPO (``importance_sampling="sequence"``, Qwen3's Group Sequence Policy Optimization): one ratio
  per completion, ``s_i = exp(mean_t (logp - old_logp))``, clipped as a whole and shared by its
  tokens (the gradient flows through the mean);
- CISPO (``loss_type="cispo"``, MiniMax-M1): ``-sg(min(ratio, 1 + eps_high)) A logp``: the ratio only
  weighs the policy gradient and is never clipped to zero gradient, so the rare tokens PPO's clip
  silences (reflection words, "wait") still learn; normalised as ``dapo``. TRL's ``epsilon_high`` is
  the cap itself (``1 + eps_high`` here).

How token losses become one number (``loss_type``):

- ``grpo``: mean over each completion's tokens, then mean over completions (the paper's 1/|o_i|);
- ``bnpo``: mean over all completion tokens of the batch;
- ``dr_grpo``: sum / (completions x max completion length) (Dr. GRPO: no length bias);
- ``dapo``: sum / completion tokens of the global batch (all ranks, all micro-batches);
- ``cispo``: as ``dapo``.

The keyword normalisers let a caller that splits a step into micro-batches (or data-parallel ranks)
pass the counts of the whole step, so that summing the micro-batch losses gives the step's loss.

Against TRL's ``GRPOTrainer`` (trl 1.16, ``tests/unit/posttrain/test_grpo_trl_reference.py``: the same rollouts,
rewards and old/reference log-probs through TRL's own scoring and ``_compute_loss``): per-token
losses, advantages (the same ``1e-4`` added to the std; ``dr_grpo`` divides by the configured
maximum completion length, ``grpo.sampling.max_new_tokens`` = TRL's ``max_completion_length``, not
the batch's width) and the loss of every type agree exactly; parameter gradients to ~3e-7 of their
largest entry (TRL's chunked LM head sums in another order). Deliberate differences:

- ``bnpo`` divides by the completion tokens of this replica's whole step; TRL divides each
  gradient-accumulation micro-batch by its own tokens and averages the micro-batches. They agree
  with one micro-batch per step; ours does not change when a memory setting (the micro-batch size)
  does.
- The KL term is DeepSeek-R1's k3. TRL 1.x by default (``use_bias_correction_kl=True``) multiplies
  it by the ratio (DeepSeek-V3.2's correction), which differs once the policy moves off the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl_lit.config.posttrain import ADVANTAGE_SCALES, GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS

STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Advantages [N] of rewards [N] laid out as consecutive groups of ``group_size`` completions.

    ``group``: ``(r - group mean) / (group std + 1e-4)``; ``batch``: the group mean is subtracted
    but the std is the whole batch's (TRL's ``scale_rewards="batch"``); ``none``: ``r - group mean``
    (Dr. GRPO). Stds are unbiased, so a group needs at least 2 completions.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale={scale!r} is unknown; choose one of {ADVANTAGE_SCALES}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of group_size={group_size} (>= 2)")
    grouped = rewards.float().view(-1, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if scale == "group":
        return centred / (grouped.std(dim=1).repeat_interleave(group_size) + STD_EPS)
    if scale == "batch":
        return centred / (rewards.float().std() + STD_EPS)
    return centred


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): ``exp(d) - d - 1`` with ``d = ref_logp - logp``."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


@dataclass
class GRPOOutput:
    loss: torch.Tensor
    """Scalar loss to backpropagate."""
    per_token: torch.Tensor
    """[batch, T] each token's loss (clipped surrogate + beta x k3), before the mask and the normaliser."""
    kl: torch.Tensor | None
    """[batch, T] per-token k3 KL (detached, 0 outside the mask), None when ``beta == 0``."""
    low_clipped: torch.Tensor
    """[batch, T] bool: ratio < 1 - eps_low with a negative advantage (the clip bounds the update)."""
    high_clipped: torch.Tensor
    """[batch, T] bool: ratio > 1 + eps_high with a positive advantage (``cispo``: whatever the
    advantage: its weight was capped)."""


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    loss_type: str = "grpo",
    *,
    num_sequences: float | torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    max_completion_length: int | None = None,
    importance_sampling: str = "token",
    rollout_weights: torch.Tensor | None = None,
) -> GRPOOutput:
    """The clipped GRPO objective over per-token log-probs [batch, T] (``logps`` with gradient,
    ``old_logps`` from the policy that sampled, ``ref_logps`` from the reference, may be None when
    ``beta == 0``), advantages [batch] and the completion mask [batch, T].

    ``num_sequences`` (``grpo``, ``dr_grpo``), ``num_tokens`` (``bnpo``, ``dapo``) and
    ``max_completion_length`` (``dr_grpo``) default to this batch's; pass the step's to normalise a
    micro-batch by the whole step. ``importance_sampling="sequence"`` is GSPO. ``rollout_weights``
    [batch, T] (detached) multiply each token's policy loss, not its KL term: the rollout correction
    (:mod:`.rollout_correction`).
    """
    if importance_sampling not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling={importance_sampling!r} is unknown; choose one of {IMPORTANCE_SAMPLING_LEVELS}")
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is unknown; choose one of {GRPO_LOSS_TYPES}")
    if beta and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps")
    mask = completion_mask.to(logps.dtype)
    log_ratio = logps - old_logps
    if importance_sampling == "sequence":  # [batch, 1]: one ratio per completion
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp_min(1)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logps.dtype).unsqueeze(-1)
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=1 + eps_high).detach() * adv * logps
    else:
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
    per_token = per_token.expand_as(logps)
    if rollout_weights is not None:
        per_token = per_token * rollout_weights
    kl = None
    if beta:
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + beta * kl
        kl = (kl * mask).detach()
    summed = per_token * mask
    if loss_type == "grpo":
        lengths = mask.sum(dim=-1).clamp_min(1)
        n = num_sequences if num_sequences is not None else logps.shape[0]
        loss = (summed.sum(dim=-1) / lengths).sum() / n
    elif loss_type in ("bnpo", "dapo", "cispo"):
        n = num_tokens if num_tokens is not None else mask.sum().clamp_min(1)
        loss = summed.sum() / n
    else:  # dr_grpo
        n = num_sequences if num_sequences is not None else logps.shape[0]
        width = max_completion_length if max_completion_length is not None else logps.shape[-1]
        loss = summed.sum() / (n * width)
    with torch.no_grad():
        active = completion_mask.bool()
        if loss_type == "cispo":
            low, high = torch.zeros_like(active), (ratio > 1 + eps_high) & active
        else:
            low = (ratio < 1 - eps_low) & (adv < 0) & active
            high = (ratio > 1 + eps_high) & (adv > 0) & active
    return GRPOOutput(loss, per_token, kl, low, high)
