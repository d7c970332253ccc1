"""Context parallelism: the sequence dimension sharded over the ``cp`` ranks of a group.

Every layer but attention works per position, so a rank runs the model on its share of the
positions and only attention needs the others: each attention layer all-gathers what it builds
its keys and values from, which for Multi-head Latent Attention is the compressed latent and the
shared rotary key (kv_lora_rank + qk_rope_head_dim = 576 numbers per token in V3, against
2 x 128 heads x 128 dims = 32768 for its full keys and values), for grouped-query attention the
rotated keys and the values of the kv heads, and for DeepSeek-V4 its one shared key/value head and its
compressors' per-token projections (the compressed windows are pooled from the whole rows on every rank).

Load balance: under a causal mask the last positions attend to the most keys, so contiguous
shards would leave rank 0 idle; the sequence is cut into ``2 cp`` chunks and rank ``r`` holds
chunks ``r`` and ``2 cp - 1 - r`` (every rank gets the same attention work), as in Llama 3's and
torchtitan's context parallelism.

The model is not changed for this: :class:`ContextParallelKeys` stands where a :class:`KVCache`
would (``cache.update`` returns the keys' sources for all positions, ``query_positions`` tells the
attention mask where this rank's queries sit), and the caller passes the rank's global positions
to the model for RoPE. Gradients flow back through the gather: each rank receives the sum, over
the ranks whose queries used them, of the gradients of its own positions.

Two more things look at whole sequences: DeepSeek-V3's MoE routing statistics (the
sequence-wise balance loss is a mean over a sequence; :func:`apply_context_parallel` gives each
MoE layer the gather) and MTP's shifted tokens and labels (taken from the whole row before
sharding, :meth:`ContextParallelKeys.shift`). Counts a loss divides by are summed over dp x cp ranks, and the
gradients averaged over them, so one cp group computes one process's step.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from dsl_lit.models.common.moe import MoE
from dsl_lit.models.common.transformer import Transformer


def rank_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions [seq_len / cp] rank ``rank`` of ``cp`` holds: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be a multiple of 2 x cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def gather_order(seq_len: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Indices that put the rank-major concatenation of every rank's positions into sequence order."""
    held = torch.cat([rank_positions(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(held)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1 in sequence order; backward returns each rank's positions' summed
    gradient (an all-reduce, then this rank's slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, positions: torch.Tensor,
                order: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.positions = group, positions
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=1)[:, order]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.positions], None, None, None


@functools.lru_cache(maxsize=16)
def _sequence_layout(seq_len: int, cp: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_positions(seq_len, cp, rank, device), gather_order(seq_len, cp, device)


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence [batch, seq_len, ...] from every rank's positions [batch, seq_len / cp, ...]
    (differentiable: each rank gets its positions' gradient summed over the ranks)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    positions, order = _sequence_layout(local.shape[1] * cp, cp, rank, local.device)
    return _GatherSequence.apply(local, group, positions, order)


class MoESequenceView:
    """An MoE layer's view of whole rows under context parallelism (``MoE.sequence``): its routing
    statistics gathered over the cp ranks. MTP depth k runs every position but the last k predict
    nothing (see ``Transformer.mtp_logits``): its layers leave those out of the balance statistics
    and the expert loads, as one process, which runs only the first ``seq - k``."""

    def __init__(self, group: dist.ProcessGroup, drop_last: int = 0) -> None:
        self.group, self.drop_last = group, drop_last

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        whole = gather_sequence(local, self.group)
        return whole[:, : whole.shape[1] - self.drop_last]

    def counted(self, batch: int, local_seq: int, device: torch.device) -> torch.Tensor | None:
        if not self.drop_last:
            return None
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        positions = _sequence_layout(local_seq * cp, cp, rank, device)[0]
        return (positions < local_seq * cp - self.drop_last).expand(batch, -1).flatten()


def apply_context_parallel(model: Transformer, group: dist.ProcessGroup) -> None:
    """Give every MoE layer its view of whole rows (attention gets the cp ranks' keys per
    forward, from :class:`ContextParallelKeys`)."""
    for module in model.layers.modules():
        if isinstance(module, MoE):
            module.sequence = MoESequenceView(group)
    for index, mtp in model.mtp.items():  # depth k = index + 1
        for module in mtp.modules():
            if isinstance(module, MoE):
                module.sequence = MoESequenceView(group, drop_last=int(index) + 1)
            if hasattr(module, "drop_last"):  # DeepSeek-V3.2's sparse attention: its indexer's objective
                module.drop_last = int(index) + 1


class ContextParallelKeys:
    """The key source of one forward under context parallelism (stands in for a ``KVCache``)."""

    def __init__(self, seq_len: int, group: dist.ProcessGroup, device: torch.device | str = "cpu") -> None:
        self.group = group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.query_positions = _sequence_layout(seq_len, cp, rank, torch.device(device))[0]
        """This rank's global positions [seq_len / cp]: its queries, and what RoPE rotates by."""
        self.length = 0  # a cache's fill level: RoPE offsets are given as positions instead

    def shard(self, sequence: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a [batch, seq_len, ...] tensor (tokens, labels, masks)."""
        return sequence[:, self.query_positions]

    def shift(self, sequence: torch.Tensor, k: int, fill: int) -> torch.Tensor:
        """This rank's positions of ``sequence`` shifted left by ``k`` (position i holds i + k;
        the last k hold ``fill``): MTP depth k's inputs and labels, taken from the whole row."""
        tail = sequence.new_full((sequence.shape[0], k, *sequence.shape[2:]), fill)
        return self.shard(torch.cat([sequence[:, k:], tail], dim=1))

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The whole rows of a tensor given at this rank's positions (differentiable)."""
        return gather_sequence(local, self.group)

    def update(self, layer_id: int, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.whole(t) for t in local)

    def advance(self, seq: int) -> None:
        """Nothing is kept between forwards."""
