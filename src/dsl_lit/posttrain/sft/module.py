"""Supervised fine-tuning: next-token loss on the assistant's tokens only.

Rows come from :mod:`dsl_lit.data.sft` with the prompt tokens' labels at -100; the loss is the
mean over the step's target tokens (as pretraining's). Packed rows carry per-document positions and
an attention mask, so packing changes throughput, not the loss, under any layout (a pipeline's
stages receive them with their micro-batch).
"""

from __future__ import annotations

import torch

from dsl_lit.ops import cross_entropy
from dsl_lit.posttrain.module import PostTrainModule
from dsl_lit.training.causal_lm import Batch, Metrics


class SFTModule(PostTrainModule):
    def loss_from_outputs(
        self, outputs: tuple[torch.Tensor, ...], micro_batch: Batch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        loss = cross_entropy(outputs[0], micro_batch["labels"]) / normalizers["targets"]
        return loss, {"loss": loss.detach()}
