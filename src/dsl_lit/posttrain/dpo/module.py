"""Direct Preference Optimization over interleaved (chosen, rejected) rows.

Both sides of every pair go through one forward (rows ``[c0, r0, c1, r1, ...]``; micro-batches hold
whole pairs). The reference log-probs are either precomputed once from the starting weights and
cached in the data rows (``reference=precompute``: no second model in memory; computed before any
checkpoint is restored, so a resumed run gets the same ones), or computed every step by a frozen
copy of the starting model (``reference=model``, saved in checkpoints as ``reference.*``).
Logged: the loss, the implicit-reward margin (chosen - rejected) and accuracy (margin > 0), and
both sides' log-probs; all are means over the step's pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from dsl_lit.config.posttrain import DPOConfig
from dsl_lit.posttrain.dpo.loss import dpo_loss
from dsl_lit.posttrain.logps import sequence_logps
from dsl_lit.posttrain.module import PostTrainModule
from dsl_lit.training.causal_lm import Batch, Metrics


class DPOModule(PostTrainModule):
    def __init__(self, *args: Any, dpo: DPOConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dpo = dpo

    @property
    def average_logps(self) -> bool:
        """IPO compares length-normalised log-probs (as TRL does)."""
        return self.dpo.loss_type == "ipo"

    def sequence_logps(self, batch: Batch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Each row's log-prob of its reply under ``model`` (default: the policy)."""
        return sequence_logps(self.logits(batch, model), batch["labels"], self.average_logps)

    @property
    def whole_model_at_start(self) -> bool:
        return True  # the reference (a copy, or log-probs) is of the whole starting model

    def on_initial_weights(self) -> None:
        if self.dpo.reference == "model":
            self.make_reference()
        else:  # the datamodule's rows are set up before configure_model
            rows = self.trainer.datamodule.rows
            rows["ref_logps"] = self.reference_logps(rows)

    @torch.no_grad()
    def reference_logps(self, rows: Batch) -> torch.Tensor:
        """[pairs, 2] log-probs of every pair's replies under the current weights (eval mode)."""
        flat = {k: v.flatten(0, 1) for k, v in rows.items() if k in ("input_ids", "labels")}
        was_training = self.model.training
        self.model.eval()
        try:
            logps = torch.cat([
                self.sequence_logps({k: v[i : i + self.micro_batch_size] for k, v in flat.items()})
                for i in range(0, flat["input_ids"].shape[0], self.micro_batch_size)
            ])
        finally:
            self.model.train(was_training)
        return logps.view(-1, 2).cpu()

    def loss_normalizers(self, batch: Batch) -> dict[str, torch.Tensor]:
        normalizers = super().loss_normalizers(batch)
        normalizers["pairs"] = normalizers["sequences"] / 2
        return normalizers

    def loss_from_outputs(
        self, outputs: tuple[torch.Tensor, ...], micro_batch: Batch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        if "ref_logps" in micro_batch:
            ref = micro_batch["ref_logps"].to(torch.float32)
        else:  # the frozen reference is whole on every rank: it runs here, on the last stage
            with torch.no_grad():
                self.reference.eval()
                ref = self.sequence_logps(micro_batch, self.reference)
        policy = sequence_logps(outputs[0], micro_batch["labels"], self.average_logps)
        out = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], self.dpo.beta, self.dpo.loss_type,
                       self.dpo.label_smoothing)
        pairs = normalizers["pairs"]
        loss = out.losses.sum() / pairs
        margin = out.chosen_rewards - out.rejected_rewards
        return loss, {
            "loss": loss.detach(),
            "rewards/margin": margin.sum() / pairs,
            "rewards/accuracy": (margin > 0).float().sum() / pairs,
            "rewards/chosen": out.chosen_rewards.sum() / pairs,
            "rewards/rejected": out.rejected_rewards.sum() / pairs,
            "logps/chosen": policy[0::2].detach().sum() / pairs,
            "logps/rejected": policy[1::2].detach().sum() / pairs,
        }
