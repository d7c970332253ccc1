"""Expert-load observability for MoE models: is the auxiliary-loss-free balancing working?

Every step it logs, from the loads of the step just taken (all micro-batches, all ranks), the
max/mean load ratio per MoE layer (1.0 is perfect balance; ``top_k`` of ``E`` experts chosen
uniformly at random gives about 1 + a few sigma), the worst and mean of those ratios, and the
spread of the expert biases. Every ``every_n_steps`` it also sends a [layer x expert] heatmap of
load / mean load to W&B (white = twice the mean or more, black = idle).

Under pipeline parallelism each rank holds only its stages' MoE layers, and only rank 0's logs
reach the loggers; the pipeline ranks therefore exchange their layers' loads and biases first, so
every rank reports every layer, in model order.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger

from dsl_lit.models.common.moe import TopKRouter
from dsl_lit.parallel.step_runner import step_runner_of


def load_ratios(loads: torch.Tensor) -> torch.Tensor:
    """max / mean load per row of ``loads`` [layers, experts]."""
    return loads.max(dim=-1).values / loads.mean(dim=-1).clamp_min(1e-9)


def heatmap(loads: torch.Tensor, cell: int = 8) -> np.ndarray:
    """uint8 image of load / mean load per layer (rows) and expert (columns), clipped at 2x."""
    relative = (loads / loads.mean(dim=-1, keepdim=True).clamp_min(1e-9)).clamp(0, 2) / 2
    pixels = (relative.cpu().numpy() * 255).astype(np.uint8)
    return np.kron(pixels, np.ones((cell, cell), dtype=np.uint8))


def layer_order(name: str) -> tuple[int, int]:
    """Model order of an MoE layer's name: the blocks (``layers.<i>``), then the MTP modules."""
    kind, _, index = name.partition(".")
    return (0 if kind == "layers" else 1, int(index) if index.isdigit() else 0)


def stage_loads(pl_module: L.LightningModule) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(layer names, loads [layers, experts], expert biases [layers, experts]) of this rank's MoE
    layers from the last step; empty on a pipeline stage without any."""
    routers = [(n, m) for n, m in pl_module.model.named_modules() if isinstance(m, TopKRouter)]
    loads = getattr(pl_module, "last_expert_load", None)
    if not routers or loads is None:
        return [], torch.zeros(0, 0), torch.zeros(0, 0)
    names = [n.removesuffix(".feed_forward.gate").removesuffix(".block") for n, _ in routers]
    biases = torch.stack([m.expert_bias.detach() for _, m in routers])
    return names, loads.detach().float().cpu(), biases.float().cpu()


def all_stages(part: tuple[list[str], torch.Tensor, torch.Tensor], group: dist.ProcessGroup | None
               ) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Every pipeline stage's layers, in model order (collective over ``group``; a layer held by
    several ranks, such as a V schedule's, counts once)."""
    if group is None or dist.get_world_size(group) == 1:
        parts = [part]
    else:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, part, group=group)
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for names, loads, biases in parts:
        for name, load, bias in zip(names, loads, biases):
            rows.setdefault(name, (load, bias))
    names = sorted(rows, key=layer_order)
    if not names:
        return [], torch.zeros(0, 0), torch.zeros(0, 0)
    return names, torch.stack([rows[n][0] for n in names]), torch.stack([rows[n][1] for n in names])


class ExpertLoadMonitor(L.Callback):
    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        group = step_runner_of(trainer.strategy).pp_group  # None unless pipeline parallel
        names, loads, biases = all_stages(stage_loads(pl_module), group)
        if not names:
            return
        ratios = load_ratios(loads)
        metrics = {
            "moe/load_max_over_mean": ratios.mean(),
            "moe/load_max_over_mean_worst": ratios.max(),
            "moe/bias_abs_mean": biases.abs().mean(),
            "moe/bias_min": biases.min(),
            "moe/bias_max": biases.max(),
        }
        for name, ratio in zip(names, ratios):
            metrics[f"moe/load_max_over_mean/{name}"] = ratio
        pl_module.log_dict(metrics)
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    logger.log_image("moe/expert_load", [heatmap(loads)], step=step,
                                     caption=[f"rows: {', '.join(names)}"])
