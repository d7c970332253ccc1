"""The Lightning Strategy that runs our LightningModules on a device mesh.

Today it does data parallelism over ``trainer.devices x trainer.num_nodes`` processes (gloo on CPU,
NCCL on GPU), plain or with ZeRO-1 (``parallel.zero1``); tensor, pipeline and expert parallelism
are validated by :mod:`dsl_lit.parallel.layout` and arrive next.

Why not Lightning's DDPStrategy as is: DDP all-reduces on every backward, but our modules run
several micro-batches per optimizer step inside ``training_step`` (so that a pipeline schedule or
ZeRO-1 can own the step). Here gradients accumulate locally over the micro-batches and are
reduced once per step by :meth:`DeepSeekStrategy.finish_gradients` (mean over dp, in buckets, or
reduce-scattered onto ZeRO-1 shards), followed by a global-norm clip. The model is not wrapped, so
module names stay the single-device ones and checkpoints do not depend on the layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from dsl_lit.optim import OptimConfig, build_optimizer, param_groups
from dsl_lit.optim.clip import clip_grad_norm_
from dsl_lit.parallel.zero1 import ZeRO1AdamW

BUCKET_NUMEL = 16 * 2**20  # 64 MiB of fp32 per all-reduce: few calls, bounded extra memory


def _grad_buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if size and size + p.numel() > BUCKET_NUMEL:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    return [b for b in buckets if b]


class DeepSeekStrategy(DDPStrategy):
    strategy_name = "dsl_lit"

    def __init__(self, zero1: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.zero1 = zero1

    # -- data-parallel coordinates (the data module shards batches by these) ------------------------
    @property
    def dp_rank(self) -> int:
        return self.global_rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    # -- no DDP wrapper ---------------------------------------------------------------------------
    def configure_ddp(self) -> None:
        """Keep the module unwrapped; start every rank from rank 0's weights and buffers."""
        if dist.is_available() and dist.is_initialized():
            with torch.no_grad():
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(tensor, src=0)

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        """AdamW, or with ``parallel.zero1`` its dp-sharded form (same hyperparameters)."""
        if not (self.zero1 and self.world_size > 1):
            return build_optimizer(model, cfg)
        return ZeRO1AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)

    @torch.no_grad()
    def finish_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
        """Reduce the step's accumulated gradients over dp and clip them by the global norm."""
        if isinstance(optimizer, ZeRO1AdamW):
            return optimizer.reduce_gradients(max_norm)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # a parameter unused on this rank still takes part in every all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size > 1:
            for bucket in _grad_buckets(params):
                flat = torch.cat([p.grad.flatten() for p in bucket])
                dist.all_reduce(flat)
                flat /= self.world_size
                offset = 0
                for p in bucket:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        return clip_grad_norm_(params, max_norm)
