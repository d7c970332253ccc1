"""A step's sampled completions (``Rollouts``) and the training rows made from them.

Completions are kept as token lists, ``group_size`` consecutive ones per prompt, so groups from
several generation calls (DAPO's dynamic sampling draws prompts until the batch is full) can be
selected and joined before the rows are built; the rows of one call are exactly the sampler's own
``sequences`` (left-padded prompts, completions padded after their end-of-sequence token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsl_lit.models.common.routing_replay import UNRECORDED
from dsl_lit.posttrain.grpo.loss import group_advantages
from dsl_lit.posttrain.module import shifted_completion
from dsl_lit.training.causal_lm import Batch


@dataclass
class Rollouts:
    prompts: list[list[int]]
    """The prompt of every completion (each prompt repeated ``group_size`` times)."""
    completions: list[list[int]]
    """Generated ids, cut after the end-of-sequence token (a truncated one has none)."""
    rewards: torch.Tensor
    """[N] the weighted rule rewards (what dynamic sampling compares within a group)."""
    penalty: torch.Tensor
    """[N] DAPO's soft overlong punishment (0 when off), added to the rewards for the advantages."""
    parts: dict[str, torch.Tensor]
    """Each reward component [N], for logging."""
    group_size: int
    logprobs: list[list[float]] | None = None
    """The sampler's log-probability of each completion token at the sampling temperature (the
    rollout forward: KV-cache decoding, eval mode), for the mismatch metrics and the rollout
    correction; None where the rollouts came from elsewhere."""
    routes: list[torch.Tensor] | None = None
    """Per completion, the experts the sampler sent each of its forwarded tokens to (prompt and
    completion, all but the last token): ``[len(prompt) + len(completion) - 1, routers, k]``
    (:mod:`dsl_lit.models.common.routing_replay`); None for a dense model or no recording."""

    @property
    def total(self) -> torch.Tensor:
        """[N] the reward the advantages are computed from."""
        return self.rewards + self.penalty

    @property
    def num_groups(self) -> int:
        return len(self.completions) // self.group_size

    def lengths(self) -> torch.Tensor:
        """[N] completion lengths in tokens (the end-of-sequence token included)."""
        return torch.tensor([len(c) for c in self.completions], dtype=torch.float32)

    def truncated(self, eos_id: int) -> torch.Tensor:
        """[N] bool: completions that stopped at the length budget, without an end-of-sequence token."""
        return torch.tensor([not c or c[-1] != eos_id for c in self.completions], dtype=torch.bool)

    def select(self, groups: Sequence[int]) -> Rollouts:
        """The given prompt groups, in that order."""
        rows = [g * self.group_size + i for g in groups for i in range(self.group_size)]
        index = torch.tensor(rows, dtype=torch.long)
        return Rollouts([self.prompts[r] for r in rows], [self.completions[r] for r in rows], self.rewards[index],
                        self.penalty[index], {k: v[index] for k, v in self.parts.items()}, self.group_size,
                        None if self.logprobs is None else [self.logprobs[r] for r in rows],
                        None if self.routes is None else [self.routes[r] for r in rows])

    @staticmethod
    def cat(parts: Sequence[Rollouts]) -> Rollouts:
        """The groups of several rollouts, one after the other."""
        return Rollouts([p for r in parts for p in r.prompts], [c for r in parts for c in r.completions],
                        torch.cat([r.rewards for r in parts]), torch.cat([r.penalty for r in parts]),
                        {k: torch.cat([r.parts[k] for r in parts]) for k in parts[0].parts}, parts[0].group_size,
                        None if any(r.logprobs is None for r in parts) else [lp for r in parts for lp in r.logprobs],
                        None if any(r.routes is None for r in parts) else [x for r in parts for x in r.routes])


def rollout_sequences(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                      pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sequences [N, P + T], valid [N, P + T] bool, P): prompts left-padded to the longest (P),
    completions right-padded to the longest (T), as :func:`dsl_lit.inference.generation.generate` lays them out."""
    width, steps = max(map(len, prompts)), max(map(len, completions))
    sequences = torch.full((len(prompts), width + steps), pad_id, dtype=torch.long)
    valid = torch.zeros_like(sequences, dtype=torch.bool)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        sequences[i, width - len(prompt) : width] = torch.tensor(prompt, dtype=torch.long)
        sequences[i, width : width + len(completion)] = torch.tensor(completion, dtype=torch.long)
        valid[i, width - len(prompt) : width + len(completion)] = True
    return sequences, valid, width


def training_rows(rollouts: Rollouts, *, pad_id: int, eos_id: int, advantage_scale: str = "group",
                  filter_overlong: bool = False) -> tuple[Batch, torch.Tensor]:
    """(rows, truncated [N] bool): ``input_ids``, ``labels`` (the completions), ``attention_mask``,
    the group ``advantages`` and, where the sampler recorded them, ``rollout_logps`` (aligned with
    ``labels``, 0 elsewhere) and ``routed_experts`` ([rows, seq, routers, k] aligned with
    ``input_ids``, -1 at padding). With ``filter_overlong`` (DAPO's overlong filtering) a truncated
    completion has no labels, so it adds nothing to the loss nor to the token counts; its reward
    still counts in its group's mean and std."""
    sequences, valid, prompt_length = rollout_sequences(rollouts.prompts, rollouts.completions, pad_id)
    rows = shifted_completion(sequences, valid, prompt_length)
    rows["advantages"] = group_advantages(rollouts.total, rollouts.group_size, advantage_scale)
    if rollouts.logprobs is not None:
        rows["rollout_logps"] = torch.zeros(rows["labels"].shape)
        for i, logprobs in enumerate(rollouts.logprobs):  # label j is token j + 1: completion token t at P - 1 + t
            rows["rollout_logps"][i, prompt_length - 1 : prompt_length - 1 + len(logprobs)] = torch.tensor(logprobs)
    if rollouts.routes is not None:
        first = rollouts.routes[0]
        routed = torch.full((*rows["input_ids"].shape, *first.shape[1:]), UNRECORDED, dtype=first.dtype)
        for i, (prompt, routes) in enumerate(zip(rollouts.prompts, rollouts.routes)):
            routed[i, prompt_length - len(prompt) : prompt_length - len(prompt) + len(routes)] = routes
        rows["routed_experts"] = routed
    truncated = rollouts.truncated(eos_id)
    if filter_overlong:
        rows["labels"][truncated] = -100
    return rows, truncated
