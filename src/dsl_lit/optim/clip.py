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


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    if not tensors:
        return None
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]).square().sum()


def squared_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all elements, in float64 (a 0-d tensor on the tensors' device).

    Tensor-parallel (DTensor) tensors count every shard once: the squares of sharded ones are
    summed over their mesh, replicated ones are counted on this rank only."""
    replicated: list[torch.Tensor] = []
    sharded: dict[int, tuple[list[torch.Tensor], object]] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            if any(p.is_shard() for p in t.placements):
                sharded.setdefault(id(t.device_mesh), ([], t.device_mesh))[0].append(t.to_local())
                continue
            t = t.to_local()
        replicated.append(t)
    total = _sum_of_squares(replicated)
    for shards, mesh in sharded.values():
        part = _sum_of_squares(shards)
        dist.all_reduce(part, group=mesh.get_group())
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=torch.float64)


@torch.no_grad()
def clip_by_norm_(
    tensors: Iterable[torch.Tensor], norm: torch.Tensor, max_norm: float | None, loss_scale: float = 1.0
) -> torch.Tensor:
    """Scale ``tensors`` in place by min(1, max_norm / (norm + 1e-6)) (clip_grad_norm_'s rule);
    returns ``norm`` as fp32.

    ``loss_scale``: the gradients are of a loss multiplied by it (fp16 loss scaling); they are
    unscaled in the same pass and the returned norm is the unscaled one. Non-finite norms leave
    the gradients untouched (the step will be skipped).

    No host sync: the coefficient stays a device tensor (one ``_foreach_mul_``), as in
    ``torch.nn.utils.clip_grad_norm_``; reading the norm on the host (``.item()``, ``if norm``) would
    stall the CPU every step until the GPU finished the backward."""
    norm = norm / loss_scale
    if not max_norm and loss_scale == 1.0:
        return norm.float()
    coef = torch.full((), 1.0 / loss_scale, dtype=torch.float64, device=norm.device)
    if max_norm:
        coef = coef * (max_norm / (norm + 1e-6)).clamp(max=1.0)
    coef = torch.where(torch.isfinite(norm), coef, 1.0).float()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        by_device.setdefault(local.device, []).append(local)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device, non_blocking=True))
    return norm.float()


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float | None,
    sum_over: dist.ProcessGroup | None = None,
    loss_scale: float = 1.0,
) -> torch.Tensor:
    """Like ``torch.nn.utils.clip_grad_norm_`` with the norm in float64; returns the norm.

    ``sum_over``: a group whose ranks hold *different* parameters (pipeline stages), whose squares
    add up to the model's norm. ``loss_scale``: see :func:`clip_by_norm_`."""
    grads = [p.grad for p in params if p.grad is not None]
    square = squared_norm(grads)
    if sum_over is not None:
        dist.all_reduce(square, group=sum_over)
    return clip_by_norm_(grads, square.sqrt(), max_norm, loss_scale)
