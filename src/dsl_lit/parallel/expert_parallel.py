"""Expert parallelism: the routed experts of every MoE layer are split over the ``ep`` ranks and
token copies travel to their experts' rank and back by all-to-all (DeepSeek-V3 section 3.2).

Applied from outside the model, like the tensor-parallel plans: :func:`apply_expert_parallel`
turns each ``GroupedExperts`` stack (w1 / w2 / w3, [experts, out, in]) into a DTensor parameter
``Shard(0)`` over the 1-D ep mesh, names unchanged, so ep rank ``r`` holds experts
``[r E/ep, (r+1) E/ep)`` and the strategy's ``full_tensor()`` on save and ``distribute_tensor`` on
load work by name. The MoE instance gets an all-to-all ``_dispatch``; the router, the shared
experts, the loads and the balance loss are untouched: every rank routes its own tokens.

The ep ranks are data-parallel ranks (``parallel.ep`` divides dp). A rank's local expert gradient
already sums the contributions of every token the ep group sent it, so the routed experts reduce
over the *expert-data-parallel* group only (the dp ranks holding the same experts) while dividing
by the full dp size; the other parameters reduce over dp as usual (:func:`expert_parameters`
tells them apart, see ``OverlappedGradientReducer``).

Node-limited routing is meant to bound a token's communication: with ``n_limited_groups <
n_expert_groups`` the expert groups must line up with the ep ranks (one divides the other), so a
token reaches at most :func:`max_ranks_per_token` ranks.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.moe import (
    MoE,
    combine_expert_outputs,
    expert_counts,
    grouped_swiglu,
    in_expert_dtype,
)

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def max_ranks_per_token(cfg: ModelConfig, ep: int) -> int:
    """Most ep ranks one token's copies can reach under ``cfg``'s routing (groups aligned to ranks)."""
    bound = min(cfg.n_activated_experts, ep)
    groups, limited = cfg.n_expert_groups, cfg.n_limited_groups
    if limited < groups:
        if groups % ep == 0:  # each rank holds groups/ep whole groups
            bound = min(bound, limited)
        elif ep % groups == 0:  # each group spans ep/groups ranks
            bound = min(bound, limited * (ep // groups))
    return bound


def ranks_per_token(indices: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """For a routing result ``indices`` [tokens, k] (expert ids), the number of distinct ep ranks
    each token is sent to ([tokens], int64), with contiguous blocks of experts per rank."""
    rank = indices // (n_experts // ep)
    hit = torch.zeros(indices.shape[0], ep, dtype=torch.bool, device=indices.device)
    return hit.scatter_(1, rank, True).sum(dim=1)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' stacked weights, in ``model.parameters()`` order: their gradients reduce
    over the expert-data-parallel group instead of all dp ranks."""
    ids = {id(getattr(m.experts, name)) for m in model.modules() if isinstance(m, MoE) for name in EXPERT_WEIGHTS}
    return [p for p in model.parameters() if id(p) in ids]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's routed experts over the 1-D ``ep_mesh`` (in place) and make its
    dispatch an all-to-all. Replicas must hold the same weights (rank 0 of ``ep_mesh`` is the
    source, as when loading); a mesh of size 1 leaves the model as it is."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_expert_parallel needs a 1-D ep mesh, got {ep_mesh.ndim} dims")
    ep = ep_mesh.size()
    if ep == 1:
        return
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if experts.n_experts % ep:
            raise ConfigError(f"parallel.ep={ep} does not divide model.n_routed_experts={experts.n_experts}")
        if experts.backend == "loop":
            raise ConfigError(f"model.expert_backend=loop cannot run with parallel.ep={ep}; use grouped_mm or split")
        for name in EXPERT_WEIGHTS:
            weight = getattr(experts, name)
            if isinstance(weight, DTensor):
                raise ValueError(f"{name} of {type(experts).__name__} is already a DTensor: apply expert parallelism once")
            shard = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=weight.requires_grad))
        module.ep_group = ep_mesh.get_group()
        module._dispatch = types.MethodType(_all_to_all_dispatch, module)


def _all_to_all_dispatch(
    self: MoE, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """``MoE._dispatch`` over ep ranks: sort copies by expert (hence by destination rank), send
    them, run the local experts on what arrived, send the outputs back, scale by the gate and
    scatter-add (:func:`combine_expert_outputs`). Every rank takes part in both all-to-alls, forward and backward."""
    group = self.ep_group
    ep = dist.get_world_size(group)
    n_local = self.n_experts // ep
    flat_ids = indices.flatten()
    order = flat_ids.argsort(stable=True)
    counts = expert_counts(flat_ids, self.n_experts)
    token_of = order // self.top_k
    # recv_counts[src, e]: copies rank src sends to this rank's local expert e
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep, n_local)
    send_splits = counts.view(ep, n_local).sum(dim=1).tolist()
    recv_splits = recv_counts.sum(dim=1).tolist()  # the one host sync: all_to_all needs sizes
    received = all_to_all_single_autograd(flat.index_select(0, token_of), recv_splits, send_splits, group)
    # arrivals are ordered (source rank, local expert); the experts want (local expert, source rank)
    local_ids = torch.arange(n_local, device=flat.device).repeat(ep)
    local_ids = local_ids.repeat_interleave(recv_counts.flatten(), output_size=sum(recv_splits))
    regroup = local_ids.argsort(stable=True)
    x = received.index_select(0, regroup)
    w1, w2, w3 = self.experts.stacked_weights()
    if x.shape[0]:
        out = grouped_swiglu(x, recv_counts.sum(dim=0), w1, w2, w3, self.experts.backend, limit=self.experts.limit)
    else:  # nothing arrived: stay in the graph (x and weights) so backward's all-to-all and grad hooks run,
        # answering in the experts' dtype as the other ranks do (else, under bf16 autocast, a rank sent
        # bf16 rows would leave half of its fp32 output buffer unwritten: garbage in the combine)
        x = in_expert_dtype(x)
        out = x * 0 + (w1.sum() + w2.sum() + w3.sum()).to(x.dtype) * 0
    out = out.index_select(0, regroup.argsort())  # back to (source rank, local expert)
    returned = all_to_all_single_autograd(out, send_splits, recv_splits, group)
    return combine_expert_outputs(returned, weights, order, torch.zeros_like(flat))
