"""Low-precision copies of fp32 weights kept between forwards: cast once per weight update, not per use.

Why: under bf16 autocast the routed experts' stacked fp32 weights are cast to bf16 by every forward
that uses them (``torch._grouped_mm`` is not an autocast op, so the cast is ours, and autocast's own
weight cache lives only as long as one autocast region): once per micro-batch, again in an
activation-recompute replay, and once per generated token in sampling. An MoE's experts are most of
its parameters, so that cast (read 4 bytes, write 2 per parameter) scales with the *total*, not the
active, parameters. :class:`ComputeCopies` keeps the bf16 copies and recasts them only when a weight
changed (its version counter moved: an optimizer step, a checkpoint load) or moved (a new storage):
with ``k`` micro-batches per step the experts are cast once instead of ``k`` (or ``2k`` with
recompute) times; generation casts them once per rollout instead of once per token. Costs 2 bytes per
copied parameter, kept between steps (Megatron keeps bf16 parameters beside fp32 main weights too).

Gradients are those of the plain cast, bit for bit: the forward returns the copy's values (the same
rounding of the same fp32 weight), the backward casts the incoming gradient to the weight's dtype
(:class:`ReusedCopy`), as autograd's ``ToCopyBackward`` does.

Under ``torch.compile`` a graph cannot check version counters, so every code path that runs the
blocks calls :func:`refresh_compute_copies` before them, outside the compiled regions (the model's
forward, a pipeline stage's, pipeline generation); an eager forward refreshes its copies itself.
``precision.expert_weight_copies`` turns them on (:mod:`dsl_lit.precision.weight_copies`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ReusedCopy(torch.autograd.Function):
    """``weight`` as ``copy`` holds it (its cast to a lower dtype, made earlier); the gradient goes
    back to ``weight`` cast to its dtype, as a plain ``weight.to(copy.dtype)`` would send it."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.weight_dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.weight_dtype), None


def _plain(weight: torch.Tensor) -> bool:
    """A plain tensor (not a tensor subclass such as torchao's FP8 weight wrapper, which casts itself)."""
    return type(weight) in (torch.Tensor, torch.nn.Parameter)


class ComputeCopies:
    """Copies of a fixed list of weights (the same weights at every call, as the forward sees them:
    a DTensor's local shard) in a compute dtype, recast when a weight changed."""

    def __init__(self) -> None:
        self.tensors: tuple[torch.Tensor, ...] | None = None
        self.keys: tuple[tuple[int, int], ...] | None = None
        """(version, data pointer) of each weight when copied."""
        self.casts = 0
        """Weights cast so far (what the tests and benchmarks count)."""

    @staticmethod
    def applies(weights: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> bool:
        """Whether copies serve a forward computing in ``dtype`` (None: no autocast) with these weights."""
        return dtype is not None and all(_plain(w) and w.dtype != dtype and w.is_floating_point() for w in weights)

    @torch.no_grad()
    def refresh(self, weights: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
        """Make the copies current: cast the weights that changed since they were copied (all of them
        the first time, or when the dtype or a shape changed)."""
        keys = tuple((w._version, w.data_ptr()) for w in weights)
        with torch.inference_mode(False):  # copies made during sampling must serve training too
            current = self.tensors
            if current is None or len(current) != len(weights) or any(
                c.dtype != dtype or c.shape != w.shape or c.device != w.device for c, w in zip(current, weights)
            ):
                self.tensors = tuple(w.detach().to(dtype) for w in weights)
                self.casts += len(weights)
            elif keys != self.keys:
                for copy, weight, key, old in zip(current, weights, keys, self.keys):
                    if key != old:
                        copy.copy_(weight.detach())
                        self.casts += 1
            else:
                return
        self.keys = keys

    def reuse(self, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The weights as their copies hold them, differentiable back to the weights."""
        assert self.tensors is not None, "ComputeCopies.reuse before refresh"
        return tuple(ReusedCopy.apply(w, c) for w, c in zip(weights, self.tensors))


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on ``device`` here, or None when autocast is off (or the tensors
    are not allocated: a module a pipeline stage pruned stays on the meta device)."""
    if device.type == "meta" or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """The tensor a forward computes with: a DTensor's local shard (differentiable), else ``weight``."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


COPY_OWNERS = "compute_copy_owners"
"""Attribute of a model listing its modules that keep copies (set where they are turned on)."""


def refresh_compute_copies(model: nn.Module) -> None:
    """Bring every kept copy of ``model``'s modules up to date before its blocks run (eager code,
    outside the compiled blocks; a check of version counters while nothing changed)."""
    owners: Iterable[nn.Module] = getattr(model, COPY_OWNERS, ())
    for owner in owners:
        owner.stacked_weights()
