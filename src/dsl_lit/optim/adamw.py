"""AdamW with DeepSeek's defaults and no weight decay on norms and biases."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def param_groups(model: nn.Module, weight_decay: float, exclude: frozenset[int] = frozenset()) -> list[dict]:
    """Decay matrices (linear and embedding weights); leave 1-D tensors (norm scales, biases) alone.
    Parameters whose ``id`` is in ``exclude`` are left out (another optimizer's groups hold them)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in exclude:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""Per-parameter state held in ``moments_dtype`` (AdamW's two moments; Muon's momentum)."""


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
            loss = super().step(closure)
            self._mark_fused_writes()
            return loss
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p, state in self.stepped(group):
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

    def _mark_fused_writes(self) -> None:
        """Move the version counter of every parameter the fused kernel updated, as any other in-place
        update does: ``torch._fused_adamw_`` writes the parameters without it (measured on CPU, torch
        2.13), so whatever keys on versions (the experts' bf16 copies,
        :mod:`dsl_lit.models.common.compute_copies`) would keep serving the weights of before the step."""
        for group in self.param_groups:
            if group.get("fused"):
                # a DTensor's local shard (what a forward computes with) has a counter of its own
                torch.autograd.graph.increment_version(
                    [t for p in group["params"] if p.grad is not None
                     for t in ((p, p._local_tensor) if isinstance(p, DTensor) else (p,))])

    def load_state_dict(self, state_dict) -> None:
        """torch casts loaded moments to the parameters' dtype; put them back in ours."""
        super().load_state_dict(state_dict)
        if self.moments_dtype != torch.float32:
            for state in self.state.values():
                for key in MOMENT_KEYS:
                    if key in state:
                        state[key] = state[key].to(self.moments_dtype)

    def stepped(self, group: dict) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """``(param, state)`` for each of ``group``'s parameters with a gradient, its ``step``
        counted on (the state made by :meth:`state_template` on its first step)."""
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(self.state_template(p))
            state["step"] += 1
            yield p, state

    def state_template(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zeroed state shaped and placed like ``param``'s: what a sharded checkpoint is read into
        (the optimizer may have no state yet)."""
        return {
            "step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, dtype=self.moments_dtype),
            "exp_avg_sq": torch.zeros_like(param, dtype=self.moments_dtype),
        }
