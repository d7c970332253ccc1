"""The base LightningModule every objective (pretrain, SFT, DPO, GRPO) derives from.

Why manual optimization: one ``training_step`` is one optimizer step over this rank's share of the
global batch. The module splits it into micro-batches and runs forward+backward for each, so the
same module can later hand the whole step to a pipeline schedule (which owns its own backward) or
to a ZeRO-1 optimizer, with no private Lightning loop internals. Subclasses only say what the loss
of a micro-batch is and how many targets a batch holds.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.optim import OptimConfig, ScheduleConfig, build_lr_scheduler, build_optimizer

Batch = dict[str, torch.Tensor]


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Split every tensor of ``batch`` along dim 0 into chunks of ``micro_batch_size`` rows."""
    size = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)]


class CausalLMModule(L.LightningModule):
    def __init__(
        self,
        model_config: ModelConfig,
        optim: OptimConfig,
        schedule: ScheduleConfig,
        micro_batch_size: int,
        total_steps: int,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model_config = model_config
        self.optim_config = optim
        self.schedule_config = schedule
        self.micro_batch_size = micro_batch_size
        self.total_steps = total_steps
        self.model: nn.Module | None = None
        self.tokens_seen = 0

    # -- model construction -------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the model here, not in ``__init__``, so a strategy can build it on the meta device
        and shard it before weights are materialised. Idempotent, as Lightning requires."""
        if self.model is None:
            self.model = build_model(self.model_config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    # -- what a subclass defines -------------------------------------------------------------------
    def num_targets(self, batch: Batch) -> torch.Tensor:
        """How many loss terms the whole step's batch holds (the loss is normalised by it)."""
        return (batch["labels"] != -100).sum()

    def micro_batch_loss(self, micro_batch: Batch) -> torch.Tensor:
        """Summed (not averaged) loss of one micro-batch."""
        raise NotImplementedError

    def tokens_in_batch(self, batch: Batch) -> int:
        """Tokens processed by this rank in one step (for throughput; includes padding)."""
        return batch["input_ids"].numel()

    # -- one optimizer step --------------------------------------------------------------------------
    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Forward and backward over micro-batches; gradients accumulate in the (fp32) parameters.

        Returns this rank's mean loss per target for logging. Each micro-batch loss is divided by
        the target count of the whole step, so the accumulated gradient equals the gradient of the
        mean over the step however the batch is split.
        """
        total = self.num_targets(batch).clamp_min(1).to(torch.float32)
        loss_sum = torch.zeros((), device=self.device)
        for micro_batch in split_micro_batches(batch, self.micro_batch_size):
            loss = self.micro_batch_loss(micro_batch) / total
            self.manual_backward(loss)
            loss_sum += loss.detach()
        return loss_sum

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        loss = self.forward_backward(batch)
        max_norm = self.optim_config.grad_clip or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        self.tokens_seen += self.tokens_in_batch(batch) * self.trainer.world_size
        self.log("train/loss", loss, prog_bar=True, sync_dist=self.trainer.world_size > 1)
        self.log_dict({"train/lr": lr, "train/grad_norm": grad_norm.float()})
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = build_optimizer(self.model, self.optim_config)
        scheduler = build_lr_scheduler(optimizer, self.schedule_config, self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- exact resume of counters that live outside the optimizer ------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
