"""Supervised fine-tuning: next-token loss on the assistant's tokens only.

Rows come from :mod:`dsl_lit.posttrain.chat.rows` with the prompt tokens' labels at -100; the loss is the
mean over the step's target tokens (as pretraining's). Packed rows carry per-document positions and
an attention mask, so packing changes throughput, not the loss, under any layout (a pipeline's
stages receive them with their micro-batch).

With an ``eval_set`` (the task's held-out problems), held-out greedy accuracy is logged at the
start and at the end (``eval/accuracy``), as GRPO logs it.
"""

from __future__ import annotations

import logging

import torch

from dsl_lit.ops import cross_entropy
from dsl_lit.posttrain.module import PostTrainModule
from dsl_lit.training.causal_lm import Batch, Metrics

log = logging.getLogger(__name__)


class SFTModule(PostTrainModule):
    def loss_from_outputs(
        self, outputs: tuple[torch.Tensor, ...], micro_batch: Batch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        loss = cross_entropy(outputs[0], micro_batch["labels"]) / normalizers["targets"]
        return loss, {"loss": loss.detach()}

    def on_train_start(self) -> None:
        if self.eval_set:
            self.log_eval_accuracy(self.evaluate())

    def on_train_end(self) -> None:
        if self.eval_set:
            accuracy = self.final_evaluation()
            log.info("sft: held-out greedy accuracy %.3f at step %d", accuracy, self.trainer.global_step)
