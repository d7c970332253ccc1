"""Weighted sums of rule-based rewards, the form GRPO consumes.

``WeightedRewards({"accuracy": 1.0, "format": 0.5})`` scores a batch of completions and returns the
total per completion plus each component (logged separately, so a run shows which rule moved).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dsl_lit.posttrain.rewards.accuracy import accuracy_reward
from dsl_lit.posttrain.rewards.format import format_reward
from dsl_lit.posttrain.rewards.language import language_consistency_reward
from dsl_lit.posttrain.rewards.restatement import restatement_reward

RewardFunction = Callable[[str, Mapping[str, Any]], float]
REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "language": language_consistency_reward,
    "restatement": restatement_reward,
}


class WeightedRewards:
    """``sum_k weight_k * reward_k(completion, sample)`` over named reward functions."""

    def __init__(self, weights: Mapping[str, float], functions: Mapping[str, RewardFunction] | None = None) -> None:
        functions = {**REWARD_FUNCTIONS, **(functions or {})}
        unknown = sorted(set(weights) - set(functions))
        if unknown:
            raise ValueError(f"unknown reward(s) {unknown}; known: {sorted(functions)}")
        if not weights:
            raise ValueError("at least one reward needs a weight")
        self.weights = dict(weights)
        self.functions = {name: functions[name] for name in weights}

    def __call__(self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total [N], {name: component [N]}) for N completions and their samples."""
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        parts = {
            name: torch.tensor([float(fn(c, s)) for c, s in zip(completions, samples)], dtype=torch.float32)
            for name, fn in self.functions.items()
        }
        total = sum(self.weights[name] * value for name, value in parts.items())
        return total, parts


def build_rewards(weights: Mapping[str, float]) -> WeightedRewards:
    """The rewards of a config's ``rewards`` mapping (name -> weight; zero weights are dropped)."""
    return WeightedRewards({k: float(v) for k, v in weights.items() if float(v) != 0.0})
