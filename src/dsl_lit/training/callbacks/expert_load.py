"""Expert-load observability for MoE models: is the auxiliary-loss-free balancing working?

Every step it logs, from the loads of the step just taken (all micro-batches, all ranks), the
max/mean load ratio per MoE layer (1.0 is perfect balance; ``top_k`` of ``E`` experts chosen
uniformly at random gives about 1 + a few sigma), the worst and mean of those ratios, and the
spread of the expert biases. Every ``every_n_steps`` it also sends a [layer x expert] heatmap of
load / mean load to W&B (white = twice the mean or more, black = idle).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import WandbLogger

from dsl_lit.models.common.moe import TopKRouter


def load_ratios(loads: torch.Tensor) -> torch.Tensor:
    """max / mean load per row of ``loads`` [layers, experts]."""
    return loads.max(dim=-1).values / loads.mean(dim=-1).clamp_min(1e-9)


def heatmap(loads: torch.Tensor, cell: int = 8) -> np.ndarray:
    """uint8 image of load / mean load per layer (rows) and expert (columns), clipped at 2x."""
    relative = (loads / loads.mean(dim=-1, keepdim=True).clamp_min(1e-9)).clamp(0, 2) / 2
    pixels = (relative.cpu().numpy() * 255).astype(np.uint8)
    return np.kron(pixels, np.ones((cell, cell), dtype=np.uint8))


class ExpertLoadMonitor(L.Callback):
    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        loads = getattr(pl_module, "last_expert_load", None)
        if loads is None:
            return
        names = [n for n, m in pl_module.model.named_modules() if isinstance(m, TopKRouter)]
        ratios = load_ratios(loads.float())
        biases = torch.cat([m.expert_bias for m in pl_module.model.modules() if isinstance(m, TopKRouter)])
        metrics = {
            "moe/load_max_over_mean": ratios.mean(),
            "moe/load_max_over_mean_worst": ratios.max(),
            "moe/bias_abs_mean": biases.abs().mean(),
            "moe/bias_min": biases.min(),
            "moe/bias_max": biases.max(),
        }
        for name, ratio in zip(names, ratios):
            layer = name.removesuffix(".feed_forward.gate").removesuffix(".block")
            metrics[f"moe/load_max_over_mean/{layer}"] = ratio
        pl_module.log_dict(metrics)
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    logger.log_image("moe/expert_load", [heatmap(loads)], step=step,
                                     caption=[f"rows: {', '.join(names)}"])
