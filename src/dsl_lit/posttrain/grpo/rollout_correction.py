"""Rollout correction: the sampler and the training forward are two networks that nearly agree.

The completions are drawn by one forward (KV-cache decoding in eval mode, token by token; under
tensor, expert or pipeline parallelism from the shards in lockstep) and trained on through another
(the whole sequence at once, in train mode). In exact arithmetic they agree; in floating point, and
in an MoE wherever a token's top-k experts flip between the two, they do not, and the policy ratio
``exp(logp - old_logp)`` is then taken between two different networks (verl, NeMo RL, AReaL and
SkyRL correct for it). With the sampler's per-token log-probs (``rollout_logps``, taken at the
sampling temperature, no top-k/top-p filtering) and the training forward's at sampling time
(``train_logps``: the current policy, or the old one for ``grpo.iterations`` > 1):

- the mismatch, logged every step: the mean ``|train - rollout|`` over completion tokens and
  ``KL(rollout || train)`` by the k3 estimator ``r - 1 - log r`` with ``r = exp(train - rollout)``
  (non-negative, unbiased under the sampler's tokens);
- token-level truncated importance sampling (TIS, ``token_cap``): each token's policy loss times
  ``min(r, token_cap)``, detached;
- sequence-level masking (MIS, ``sequence_bounds = [lo, hi]``): a completion whose sequence ratio
  ``exp(sum_t log r_t)`` leaves ``[lo, hi]`` adds no policy loss (it still counts in the normalisers
  and its KL term stays).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutCorrection:
    weights: torch.Tensor | None
    """[batch, T] detached factors of each token's policy loss (None: no correction configured)."""
    token_capped: torch.Tensor
    """[batch, T] bool: completion tokens whose ratio was truncated at ``token_cap``."""
    sequence_masked: torch.Tensor
    """[batch] bool: completions masked for a sequence ratio outside ``sequence_bounds``."""
    abs_gap: torch.Tensor
    """[batch, T] ``|train - rollout|`` (0 outside the completion mask)."""
    kl: torch.Tensor
    """[batch, T] k3 estimate of KL(rollout || train) per token (0 outside the mask)."""


@torch.no_grad()
def rollout_correction(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor,
                       token_cap: float | None = None,
                       sequence_bounds: tuple[float, float] | None = None) -> RolloutCorrection:
    """The mismatch and the correction weights of a micro-batch ([batch, T] log-probs, bool mask)."""
    valid = mask.to(train_logps.dtype)
    log_ratio = (train_logps.detach().float() - rollout_logps.float()) * valid
    ratio = log_ratio.exp()
    weights = None
    capped = torch.zeros_like(mask)
    if token_cap is not None:
        capped = (ratio > token_cap) & mask
        weights = ratio.clamp(max=token_cap) * valid
    masked = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    if sequence_bounds is not None:
        low, high = sequence_bounds
        sequence_ratio = log_ratio.sum(-1).exp()
        masked = ((sequence_ratio < low) | (sequence_ratio > high)) & mask.any(-1)
        keep = (~masked).to(valid.dtype).unsqueeze(-1) * valid
        weights = keep if weights is None else weights * keep
    return RolloutCorrection(weights, capped, masked, log_ratio.abs(), (torch.expm1(log_ratio) - log_ratio) * valid)
