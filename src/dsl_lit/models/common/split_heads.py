"""What an attention needs to know when tensor parallelism splits its heads over ranks.

The parallel layer (``dsl_lit.parallel.tensor_parallel``) shards a family's modules by its plan;
the model code stays the single-device code, reshaping with ``-1`` heads. Two things it cannot
see from its own shapes are here: a parameter it reads directly rather than through a module call
may arrive split (:func:`local_part`), and a statistic over *all* heads (DeepSeek Sparse
Attention's indexer target: the attention distribution averaged over heads) needs the other ranks'
heads (:class:`HeadMean`). Neither imports ``torch.distributed``: the sum over ranks is handed in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as this rank holds it: a distributed parameter's local shard (differentiable back
    to it), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class HeadMean:
    """Mixin of an attention module (``n_heads``: all of its heads) whose heads tensor parallelism
    may split: the mean of a per-head quantity over every head, as one process computes it."""

    n_heads: int
    sum_over_head_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Set by the tensor-parallel layer to the sum over the ranks that hold the other heads; None
    when this rank holds every head."""

    def mean_over_heads(self, per_head: torch.Tensor, dim: int) -> torch.Tensor:
        """The mean over all ``n_heads`` heads of ``per_head``, whose dimension ``dim`` holds this rank's."""
        total = per_head.sum(dim)
        if self.sum_over_head_ranks is not None:
            total = self.sum_over_head_ranks(total)
        return total / self.n_heads
