"""A few training steps of the tiny V3 (MLA, MoE, MTP) under a real Trainer, with a watch switched on
around each step after the warm-up but the last, which reads the queued checks by design (``CausalLMModule.optimizer_step_on``: forwards, backwards,
clipping, the optimizer, the schedule and the expert biases; not Lightning's logging). The GPU test
watches with ``torch.cuda.set_sync_debug_mode("error")``, the CPU test counts the operations that
make a CUDA host wait (tests/unit/optim/test_step_syncs.py)."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch.utils.data import DataLoader

from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.models import ModelConfig
from dsl_lit.parallel.strategy import DeepSeekStrategy
from dsl_lit.precision.plugin import AutocastPrecision
from dsl_lit.training.pretrain import PretrainModule

WARMUP_STEPS = 2  # the first steps create the optimizer state and warm caches


def tiny_v3(**overrides) -> ModelConfig:
    return ModelConfig.from_name("deepseek_v3_tiny", n_layers=2, **overrides)


class WatchedPretrainModule(PretrainModule):
    def __init__(self, *args, watch: Callable[[L.LightningModule], None], unwatch: Callable[[L.LightningModule], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watch, self.unwatch = watch, unwatch
        self.watched_steps = 0

    def optimizer_step_on(self, batch):
        step = self.trainer.global_step
        if step < WARMUP_STEPS or step + 1 >= self.trainer.max_steps:  # the last reads the queued checks
            return super().optimizer_step_on(batch)
        self.watch(self)
        try:
            result = super().optimizer_step_on(batch)
        finally:
            self.unwatch(self)
        self.watched_steps += 1
        return result


def run_watched_steps(device: torch.device, precision: str, watch: Callable[[L.LightningModule], None],
                      unwatch: Callable[[L.LightningModule], None],
                      steps: int = 5, checks_on_device: bool | None = None, **model) -> WatchedPretrainModule:
    """``steps`` optimizer steps of 2 micro-batches of 4 x 64 tokens; ``watch(module)`` and
    ``unwatch(module)`` around each watched step; returns the module."""
    cfg = tiny_v3(**model)
    fp8 = precision if precision.startswith("fp8") else None
    torch.manual_seed(0)
    module = WatchedPretrainModule(
        cfg, OptimConfig(lr=1e-3, grad_clip=1.0), ScheduleConfig(name="constant", warmup_steps=0), 4,
        total_steps=steps, precision=PrecisionConfig(name="bf16" if fp8 else precision, fp8=fp8),
        watch=watch, unwatch=unwatch,
    )
    module.step_checks_on_device = checks_on_device
    tokens = [torch.randint(0, cfg.vocab_size, (8, 65), generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:].clone()} for t in tokens]
    trainer = L.Trainer(accelerator=device.type, devices=1, strategy=DeepSeekStrategy(), max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        log_every_n_steps=steps, plugins=[AutocastPrecision(module.precision.name, device.type)])
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    assert module.watched_steps == steps - WARMUP_STEPS - 1
    return module
