"""The Lightning Strategy that runs our LightningModules on a device mesh.

Today it does data parallelism over ``trainer.devices x trainer.num_nodes`` processes (gloo on CPU,
NCCL on GPU), plain or with ZeRO-1 (``parallel.zero1``); tensor, pipeline and expert parallelism
are validated by :mod:`dsl_lit.parallel.layout` and arrive next.

Why not Lightning's DDPStrategy as is: DDP all-reduces on every backward, but our modules run
several micro-batches per optimizer step inside ``training_step`` (so that a pipeline schedule or
ZeRO-1 can own the step). Here gradients accumulate locally over the micro-batches and are
reduced once per step: plain DP all-reduces buckets from backward hooks during the last
micro-batch's backward (:mod:`dsl_lit.parallel.grad_sync`), ZeRO-1 reduce-scatters onto its shards;
:meth:`DeepSeekStrategy.finish_gradients` completes it and clips by the global norm. The model is not wrapped, so
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
from dsl_lit.parallel.grad_sync import OverlappedGradientReducer
from dsl_lit.parallel.zero1 import ZeRO1AdamW


class DeepSeekStrategy(DDPStrategy):
    strategy_name = "dsl_lit"

    def __init__(self, zero1: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.zero1 = zero1
        self._reducer: OverlappedGradientReducer | None = None

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

    def before_last_backward(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The module is about to run the step's last backward: arm the overlapped reduction
        (plain DP; ZeRO-1 reduce-scatters its whole shards after backward)."""
        if self.world_size == 1 or isinstance(optimizer, ZeRO1AdamW):
            return
        if self._reducer is None:
            self._reducer = OverlappedGradientReducer(model)
        self._reducer.arm()

    @torch.no_grad()
    def finish_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
        """Complete the step's gradient reduction over dp and clip by the global norm."""
        if isinstance(optimizer, ZeRO1AdamW):
            return optimizer.reduce_gradients(max_norm)
        if self.world_size > 1:
            if self._reducer is None:
                self._reducer = OverlappedGradientReducer(model)
            if not self._reducer.armed:  # no overlap was armed: wait() reduces every bucket now
                self._reducer.arm()
            self._reducer.wait()
        return clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)

    def teardown(self) -> None:
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
        super().teardown()
