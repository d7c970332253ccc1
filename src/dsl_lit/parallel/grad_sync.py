"""Data-parallel gradient reduction overlapped with the backward of the step's last micro-batch.

Gradients accumulate locally over a step's micro-batches (no communication); during the *last*
micro-batch's backward, a bucket's all-reduce starts asynchronously the moment its last gradient
is final (a post-accumulate-grad hook), so communication of the later layers runs while autograd
still computes the earlier ones (DeepSeek LLM section 3.3 overlaps this way). Buckets follow the
reverse of the parameter order, roughly the order backward produces them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BUCKET_NUMEL = 4 * 2**20  # 16 MiB of fp32: several buckets per model, so some finish early


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor-parallel (DTensor) tensor; plain tensors unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready = 0
        self.flat: torch.Tensor | None = None
        self.work: dist.Work | None = None


class LastBackwardBuckets:
    """Backward hooks shared by the DP reducer and ZeRO-1: after :meth:`arm`, count per bucket
    the parameters whose gradient became final and call ``_launch(bucket)`` once a bucket is
    complete. Buckets need ``params``, ``ready``, ``flat`` and ``work`` attributes."""

    buckets: list

    def _install_hooks(self) -> None:
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.armed = False
        self.launched_in_backward = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params]

    def arm(self) -> None:
        """The next backward is the step's last: launch buckets as their gradients become final."""
        self.armed = True
        self.launched_in_backward = 0
        for b in self.buckets:
            b.ready, b.flat, b.work = 0, None, None

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
            self.launched_in_backward += 1

    def _launch(self, bucket: object) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()


class OverlappedGradientReducer(LastBackwardBuckets):
    """Sum of gradients over ``group`` divided by ``divisor``, launched bucket by bucket from
    backward hooks.

    ``params`` is a module (all its trainable parameters) or an explicit list, so that one model
    can have several reducers: with expert parallelism the non-expert parameters reduce over the
    dp group (divisor dp: the mean), while routed experts reduce over the expert-data-parallel
    group (the ranks holding the same experts) and still divide by the full dp size, because the
    all-to-all already summed the other ep ranks' contributions into each local expert gradient.
    """

    def __init__(
        self,
        params: nn.Module | Iterable[nn.Parameter],
        group: dist.ProcessGroup | None = None,
        bucket_numel: int = BUCKET_NUMEL,
        divisor: int | None = None,
    ):
        self.group = group
        self.divisor = divisor if divisor is not None else dist.get_world_size(group)
        params = params.parameters() if isinstance(params, nn.Module) else params
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            if current and size + local(p).numel() > bucket_numel:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += local(p).numel()
        if current:
            self.buckets.append(_Bucket(current))
        self._install_hooks()

    def _launch(self, bucket: _Bucket) -> None:
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket.params]
        bucket.flat = torch.cat([g.flatten() for g in grads])
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    @torch.no_grad()
    def wait(self) -> None:
        """Finish every bucket (launching those whose hooks never fired, e.g. unused parameters)
        and write the reduced gradients (sum / divisor) back."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.flat /= self.divisor
            offset = 0
            for p in bucket.params:
                shard = local(p)  # tensor-parallel parameters reduce their local shard over dp
                chunk = bucket.flat[offset : offset + shard.numel()].view_as(shard)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local(p.grad).copy_(chunk)
                offset += shard.numel()
            bucket.flat = bucket.work = None
        self.armed = False
