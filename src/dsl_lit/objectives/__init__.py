"""Pure loss functions of the post-training objectives, shared by the LightningModules and tested
against hand-computed values: DPO (and its IPO / hinge / robust variants), GRPO's group-relative
advantages and its clipped, KL-regularised policy loss, and per-token log-probabilities."""

from dsl_lit.objectives.dpo import DPOOutput, dpo_loss
from dsl_lit.objectives.grpo import (
    GRPOOutput,
    group_advantages,
    grpo_loss,
    k3_kl,
)
from dsl_lit.objectives.logps import sequence_logps, token_logps

__all__ = [
    "DPOOutput",
    "GRPOOutput",
    "dpo_loss",
    "group_advantages",
    "grpo_loss",
    "k3_kl",
    "sequence_logps",
    "token_logps",
]
