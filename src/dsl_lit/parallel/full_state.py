"""The whole model's state on every rank, from a model sharded by tensor or expert parallelism
and pruned to pipeline stages: what an inference copy needs (GRPO samples with the current
policy; a reference model is refreshed from it).

Why a full copy: autoregressive sampling runs one token at a time over the whole model, and context-
or sequence-parallel shards split a forward over positions (tensor, expert and pipeline parallel
layouts sample from their shards instead, :meth:`PostTrainModule.inference_model`; so does expert
parallelism unless GRPO's dynamic sampling makes replicas decode different numbers of batches). RL frameworks (veRL, OpenRLHF) likewise hand the
trained weights to a separate inference engine after each update; here the engine is a plain
single-device model on every rank. At scale that engine would get a layout of its own (tensor
parallel within a node); this module is the resharding step, written for any layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def full_state_dict(model: nn.Module, pp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the single-device ``model.state_dict()``, on every rank.

    DTensors (tensor- and expert-parallel shards) are gathered over their own meshes; with a
    ``pp_group``, each pipeline rank then broadcasts the tensors of the stages it holds (a name
    held by several ranks is sent once, by the lowest). Collective: every rank of the model's
    meshes and of ``pp_group`` must call it, in the same order."""
    local = {name: t.full_tensor() if isinstance(t, DTensor) else t.detach()
             for name, t in model.state_dict().items()}
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return local
    shapes: list[dict[str, tuple[tuple[int, ...], torch.dtype]] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(shapes, {name: (tuple(t.shape), t.dtype) for name, t in local.items()}, group=pp_group)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    me = dist.get_rank(pp_group)
    full: dict[str, torch.Tensor] = {}
    for source, held in enumerate(shapes):
        for name, (shape, dtype) in held.items():
            if name in full:
                continue
            tensor = local[name].contiguous() if source == me else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, group=pp_group, group_src=source)
            full[name] = tensor
    return full
