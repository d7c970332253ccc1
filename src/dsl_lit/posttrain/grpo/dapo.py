"""DAPO's additions to GRPO (Yu et al. 2025, arXiv 2503.14476) that act on the rollouts: the soft
overlong punishment and dynamic sampling. (Clip-higher is ``grpo.eps_high``, the token-level loss
``loss_type=dapo``, overlong filtering :func:`dsl_lit.posttrain.grpo.rollout.training_rows`.)

Soft overlong punishment (DAPO eq. 13), added to the rule reward of a completion of ``|y|`` tokens:
``0`` up to ``L_max - L_cache``, then ``(L_max - L_cache - |y|) / L_cache`` down to ``-1`` at
``L_max``, and ``-1`` beyond.

Dynamic sampling: a group whose completions all earn the same reward has zero advantage under every
``advantage_scale``, so it gives no policy gradient and only dilutes the token-mean loss. Such
groups are dropped (counted) and more prompts are sampled until the batch holds as many informative
groups as the data's batch has prompts, at most ``max_draws`` batches per step. Equality is tested
on the rule rewards, without the length penalty: DAPO filters on accuracy, and completions that
differ only in length say nothing about the task (with the penalty on, nearly no group would be
dropped).
"""

from __future__ import annotations

import torch

from dsl_lit.posttrain.grpo.rollout import Rollouts


def overlong_penalty(lengths: torch.Tensor, max_length: int, cache: int) -> torch.Tensor:
    """[N] DAPO's soft length penalty in [-1, 0] of completions of ``lengths`` tokens (``cache`` 0: none)."""
    lengths = lengths.float()
    if cache == 0:
        return torch.zeros_like(lengths)
    return ((max_length - cache - lengths) / cache).clamp(-1.0, 0.0)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: groups whose rewards are not all equal (consecutive ``group_size`` rewards per group)."""
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) > grouped.amin(dim=1)


class GroupSelection:
    """The groups of one step's batch, collected draw by draw: informative groups first, in the
    order they were sampled, until ``num_groups`` are held."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.kept: list[Rollouts] = []
        self.dropped: list[Rollouts] = []
        self.draws = 0

    @property
    def num_kept(self) -> int:
        return sum(r.num_groups for r in self.kept)

    @property
    def full(self) -> bool:
        return self.num_kept >= self.num_groups

    def add(self, rollouts: Rollouts) -> None:
        """One draw's groups."""
        informative = informative_groups(rollouts.rewards, rollouts.group_size).tolist()
        self.kept.append(rollouts.select([g for g, keep in enumerate(informative) if keep]))
        self.dropped.append(rollouts.select([g for g, keep in enumerate(informative) if not keep]))
        self.draws += 1

    def batch(self) -> tuple[Rollouts, dict[str, float]]:
        """(the batch of ``num_groups`` groups, counts). Short of informative groups (the draw cap
        was reached), dropped groups fill the rest in sampling order: they bring no rule-reward
        signal (only the length penalty's, if on), and the batch keeps its shape, which every
        data-parallel replica and micro-batch relies on."""
        kept = Rollouts.cat(self.kept)
        filled = max(0, self.num_groups - kept.num_groups)
        chosen = Rollouts.cat([kept.select(range(min(kept.num_groups, self.num_groups))),
                               Rollouts.cat(self.dropped).select(range(filled))])
        counts = {"grpo/draws": float(self.draws), "grpo/dropped_groups": float(sum(r.num_groups for r in self.dropped)),
                  "grpo/filled_groups": float(filled)}
        return chosen, counts
