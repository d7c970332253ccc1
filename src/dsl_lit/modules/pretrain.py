"""Pretraining: next-token prediction over packed windows, plus DeepSeek-V3's extra terms.

For DeepSeek-V3 models the objective is ``L_main + lambda * L_MTP + L_balance``: the MTP loss is
the mean over depths k of the cross-entropy of predicting ``labels[:, k:]`` (lambda from the
``objective`` schedule), and the balance loss is what the MoE layers computed (already times its
alpha), averaged over the step's sequences. ``train/loss`` is always the main next-token loss,
so curves compare across families.
"""

from __future__ import annotations

import torch

from dsl_lit.modules.causal_lm import Batch, CausalLMModule, Metrics
from dsl_lit.ops import cross_entropy


class PretrainModule(CausalLMModule):
    def loss_normalizers(self, batch: Batch) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        normalizers = super().loss_normalizers(batch)
        normalizers["sequences"] = torch.tensor(float(labels.shape[0]), device=labels.device)
        for k in range(1, len(self.model.mtp) + 1):
            normalizers[f"mtp_{k}"] = (labels[:, k:] != -100).sum().clamp_min(1).float()
        return normalizers

    def micro_batch_loss(self, micro_batch: Batch, normalizers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        tokens, labels = micro_batch["input_ids"], micro_batch["labels"]
        hidden = self.model.hidden_states(tokens)
        loss = cross_entropy(self.model.head(hidden), labels) / normalizers["targets"]
        objective, metrics = loss, {"loss": loss.detach()}
        if len(self.model.mtp):
            mtp_logits = self.model.mtp_logits(hidden, tokens)
            mtp_loss = sum(
                cross_entropy(logits, labels[:, k:]) / normalizers[f"mtp_{k}"]
                for k, logits in enumerate(mtp_logits, start=1)
            ) / len(mtp_logits)
            weight = self.objective.mtp_weight_at(self.progress)
            objective = objective + weight * mtp_loss
            metrics["mtp_loss"] = mtp_loss.detach()
            self.log("train/mtp_weight", weight)
        balance = self.model.balance_loss()
        if balance is not None:
            balance = balance * labels.shape[0] / normalizers["sequences"]
            objective = objective + balance
            metrics["balance_loss"] = balance.detach()
        return objective, metrics
