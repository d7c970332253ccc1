"""Gradient-norm clipping with the norm accumulated in float64.

``torch.nn.utils.clip_grad_norm_`` sums squares in fp32: over a 2M-element embedding gradient that
is off by ~1e-4 relative on CPU, enough for a single process, plain DP and ZeRO-1 (which sees the
gradient as dp shards) to report different norms and clip differently. Every layout uses these
two functions, so they all clip by the same number.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def squared_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all elements, in float64 (a 0-d tensor on the tensors' device).

    Tensor-parallel (DTensor) tensors count every shard once: the squares of sharded ones are
    summed over their mesh, replicated ones are counted on this rank only."""
    total = torch.zeros((), dtype=torch.float64)
    sharded: dict[int, tuple[torch.Tensor, object]] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            part = torch.linalg.vector_norm(t.to_local(), dtype=torch.float64).square().cpu()
            if any(p.is_shard() for p in t.placements):
                key = id(t.device_mesh)
                previous = sharded.get(key, (torch.zeros((), dtype=torch.float64), t.device_mesh))[0]
                sharded[key] = (previous + part, t.device_mesh)
                continue
        else:
            part = torch.linalg.vector_norm(t, dtype=torch.float64).square().cpu()
        total = total + part
    for partial, mesh in sharded.values():
        device = mesh.device_type
        partial = partial.to(device)
        dist.all_reduce(partial, group=mesh.get_group())
        total = total + partial.cpu()
    return total


@torch.no_grad()
def clip_by_norm_(tensors: Iterable[torch.Tensor], norm: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """Scale ``tensors`` in place by min(1, max_norm / (norm + 1e-6)) (clip_grad_norm_'s rule);
    returns ``norm`` as fp32."""
    if max_norm:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for t in tensors:
            t.mul_(coef.item())
    return norm.float()


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Like ``torch.nn.utils.clip_grad_norm_`` with the norm in float64; returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    return clip_by_norm_(grads, squared_norm(grads).sqrt(), max_norm)
