"""AdamW with DeepSeek's defaults and no weight decay on norms and biases."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsl_lit.errors import ConfigError


@dataclass
class OptimConfig:
    """The ``optim`` config group (DeepSeek LLM / V3: AdamW 0.9/0.95, wd 0.1, clip 1.0)."""

    lr: float = 4.2e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    grad_clip: float = 1.0
    foreach: bool | None = None

    def validate(self) -> OptimConfig:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0 (DeepSeek LLM 7B used 4.2e-4)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps={self.eps} must be > 0")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        return self


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); leave 1-D tensors (norm scales, biases) alone."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
        foreach=cfg.foreach,
    )
