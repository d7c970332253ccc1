"""Pretraining: next-token prediction over packed windows."""

from __future__ import annotations

import torch

from dsl_lit.modules.causal_lm import Batch, CausalLMModule
from dsl_lit.ops import cross_entropy


class PretrainModule(CausalLMModule):
    """Summed next-token cross-entropy; the base class normalises by the step's target count."""

    def micro_batch_loss(self, micro_batch: Batch) -> torch.Tensor:
        logits = self.model(micro_batch["input_ids"])
        return cross_entropy(logits, micro_batch["labels"], reduction="sum")
