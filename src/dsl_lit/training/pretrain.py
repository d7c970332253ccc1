"""Pretraining: next-token prediction over packed windows, plus DeepSeek-V3's extra terms.

For DeepSeek-V3 models the objective is ``L_main + lambda * L_MTP + L_balance``: the MTP loss is
the mean over depths k of the cross-entropy of predicting ``labels[:, k:]`` (lambda from the
``objective`` schedule), and the balance loss is what the MoE layers computed (already times its
alpha), averaged over the step's sequences. ``train/loss`` is always the main next-token loss,
so curves compare across families.
"""

from __future__ import annotations

import torch

from dsl_lit.ops import cross_entropy
from dsl_lit.training.causal_lm import Batch, CausalLMModule, Metrics


class PretrainModule(CausalLMModule):
    def loss_normalizers(self, batch: Batch) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        normalizers = super().loss_normalizers(batch)
        normalizers["sequences"] = torch.full((), float(labels.shape[0]), device=labels.device)  # a fill, not a host copy
        for k in range(1, self.mtp_depth + 1):
            normalizers[f"mtp_{k}"] = self.replica_share((self.targets(labels, k) != -100).sum())
        return normalizers

    def loss_from_outputs(
        self, outputs: tuple[torch.Tensor, ...], micro_batch: Batch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        labels = micro_batch["labels"]
        logits, *mtp_logits = outputs
        targets = self.targets(labels)
        z_weight = self.objective.z_loss_weight
        # PaLM's z-loss, z_weight * mean(logsumexp(logits)^2) over the step's targets (train/z_loss),
        # from the logsumexp the kernel computes anyway: its gradient joins the in-place one, no memory
        loss, lse = cross_entropy(logits, targets, return_lse=True) if z_weight else (cross_entropy(logits, targets), None)
        loss = loss / normalizers["targets"]
        objective, metrics = loss, {"loss": loss.detach()}
        if lse is not None:
            z_loss = z_weight * torch.where(targets != -100, lse.square(), 0.0).sum() / normalizers["targets"]
            objective = objective + z_loss
            metrics["z_loss"] = z_loss.detach()
        if mtp_logits:
            mtp_loss = sum(
                cross_entropy(logits, self.targets(labels, k)) / normalizers[f"mtp_{k}"]
                for k, logits in enumerate(mtp_logits, start=1)
            ) / len(mtp_logits)
            objective = objective + self.objective.mtp_weight_at(self.progress) * mtp_loss
            metrics["mtp_loss"] = mtp_loss.detach()
        return objective, metrics

    def step_metrics(self) -> dict[str, float]:
        if not self.mtp_depth:
            return {}
        return {"mtp_weight": self.objective.mtp_weight_at(self.progress)}
