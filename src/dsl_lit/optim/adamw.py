"""AdamW with DeepSeek's defaults and no weight decay on norms and biases."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dsl_lit.config.optim import OptimConfig


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


MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose two moments can be stored in a lower precision.

    With ``moments_dtype=torch.float32`` it is torch's AdamW (foreach or fused kernels). With bf16
    moments each step upcasts them to fp32, applies the same update as torch (decoupled weight
    decay, bias corrections) in fp32 and stores them back rounded to bf16: the master weights stay
    fp32. The state dict has torch's layout (``step``, ``exp_avg``, ``exp_avg_sq``)."""

    def __init__(self, params, moments_dtype: torch.dtype = torch.float32, **kwargs) -> None:
        self.moments_dtype = moments_dtype
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        if self.moments_dtype == torch.float32:
            return super().step(closure)
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype)
                state["step"] += 1
                step = state["step"].item()
                grad = p.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                p.mul_(1 - lr * weight_decay)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        return loss

    def load_state_dict(self, state_dict) -> None:
        """torch casts loaded moments to the parameters' dtype; put them back in ours."""
        super().load_state_dict(state_dict)
        if self.moments_dtype != torch.float32:
            for state in self.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].to(self.moments_dtype)


def uses_fused_kernel(cfg: OptimConfig, params_of_one_kind: bool = True) -> bool:
    """``optim.fused``, or where it is null: the fused kernel wherever it applies (fp32 moments,
    ``optim.foreach`` unset, and each param group all plain tensors or all DTensors: the kernel
    refuses a mix, which expert parallelism makes of a group by sharding only the experts)."""
    if cfg.fused is not None:
        return cfg.fused
    return cfg.moments_dtype == "fp32" and cfg.foreach is None and params_of_one_kind


def adamw_arguments(cfg: OptimConfig, params_of_one_kind: bool = True) -> dict:
    """:class:`AdamW`'s keyword arguments from the ``optim`` group (its ZeRO-1 form takes the same)."""
    return dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=cfg.foreach,
                fused=uses_fused_kernel(cfg, params_of_one_kind) or None,
                moments_dtype=MOMENT_DTYPES[cfg.moments_dtype])


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay)
    one_kind = all(len({isinstance(p, DTensor) for p in g["params"]}) <= 1 for g in groups)
    return AdamW(groups, **adamw_arguments(cfg, one_kind))
