"""The ``objective`` config group: coefficients of DeepSeek-V3's training objective that change
during training (both as piecewise-constant functions of the fraction of training done), and the
optional z-loss of the pretraining objective.

Ignored by models without MTP modules or MoE layers, so one group serves every recipe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from data_contract.errors import ConfigError


def piecewise_constant(progress: float, values: Sequence[float], boundaries: Sequence[float]) -> float:
    """``values[i]`` while ``progress`` (fraction of training, 0..1) is below ``boundaries[i]``;
    used for coefficients that DeepSeek switches at a token count (MTP weight 0.3 -> 0.1 after
    10T of 14.8T tokens, bias update speed 0.001 -> 0 for the last 500B)."""
    for value, boundary in zip(values, boundaries):
        if progress < boundary:
            return value
    return values[len(boundaries)]


def check_piecewise(values: Sequence[float], boundaries: Sequence[float], field: str) -> None:
    """ConfigError unless there is one more value than boundaries and boundaries rise within [0, 1]."""
    if len(values) != len(boundaries) + 1:
        raise ConfigError(
            f"{field} has {len(values)} value(s) and {len(boundaries)} boundary(ies); "
            "a piecewise-constant schedule needs exactly one more value than boundaries"
        )
    if list(boundaries) != sorted(boundaries) or any(not 0.0 <= b <= 1.0 for b in boundaries):
        raise ConfigError(f"{field} boundaries {list(boundaries)} must rise within [0, 1] (fractions of training)")


@dataclass
class ObjectiveConfig:
    mtp_weight: list[float] = field(default_factory=lambda: [0.3, 0.1])
    """lambda of the MTP loss: 0.3 for the first 10T of 14.8T tokens, then 0.1."""
    mtp_weight_boundaries: list[float] = field(default_factory=lambda: [10.0 / 14.8])
    bias_update_rate: list[float] = field(default_factory=lambda: [0.001, 0.0])
    """gamma of the auxiliary-loss-free bias update: 0.001 for the first 14.3T tokens, then 0."""
    bias_update_boundaries: list[float] = field(default_factory=lambda: [14.3 / 14.8])
    z_loss_weight: float = 0.0
    """PaLM's z-loss: adds ``z_loss_weight x mean(logsumexp(logits)^2)`` over the step's targets to the
    pretraining objective (main next-token head), pushing the softmax normaliser towards 1 for
    stability; PaLM used 1e-4. 0 turns it off. Computed from the logsumexp the cross-entropy kernel
    already has (no extra memory); logged as ``train/z_loss`` (the weighted term)."""

    def validate(self, prefix: str = "objective") -> ObjectiveConfig:
        check_piecewise(self.mtp_weight, self.mtp_weight_boundaries, f"{prefix}.mtp_weight")
        check_piecewise(self.bias_update_rate, self.bias_update_boundaries, f"{prefix}.bias_update_rate")
        if any(v < 0 for v in [*self.mtp_weight, *self.bias_update_rate]):
            raise ConfigError(f"{prefix}.mtp_weight and {prefix}.bias_update_rate values must be >= 0")
        if not (isinstance(self.z_loss_weight, (int, float)) and math.isfinite(self.z_loss_weight)
                and self.z_loss_weight >= 0):
            raise ConfigError(f"{prefix}.z_loss_weight={self.z_loss_weight} must be a number >= 0 "
                              "(PaLM used 1e-4; 0 turns the z-loss off)")
        return self

    def mtp_weight_at(self, progress: float) -> float:
        return piecewise_constant(progress, self.mtp_weight, self.mtp_weight_boundaries)

    def bias_update_rate_at(self, progress: float) -> float:
        return piecewise_constant(progress, self.bias_update_rate, self.bias_update_boundaries)
