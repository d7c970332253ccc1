"""ZeRO-1 for Muon: whole parameters, not flat shards, divided among the data-parallel ranks.

Muon orthogonalises each matrix as a whole, so the flat buckets of :class:`ZeRO1AdamW` (which cut
matrices at arbitrary elements) cannot hold its state. Here each parameter has one owner in the dp
group (largest first, to the least loaded rank: torch's ``ZeroRedundancyOptimizer`` balances the
same way), which keeps its optimizer state (Muon's momentum, or AdamW's moments for the embeddings,
head and 1-D parameters) and computes its update; optimizer memory per rank is about 1/dp. One step:

1. gradients are all-reduced over dp, as without ZeRO-1 (the step runner's overlapped buckets), and
   clipped by the global norm, the same on every rank;
2. each rank steps the parameters it owns (a tensor-parallel matrix is gathered over its tp group
   for Newton-Schulz by the ranks of that group, which own the same parameters);
3. each owner's parameters are broadcast to the other dp ranks, one flat buffer per owner.

Checkpoints hold each parameter's state under its name, written by its owner
(:meth:`sharded_state_dict`), so they load into any dp size, with or without ZeRO-1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsl_lit.optim.muon import Muon
from dsl_lit.parallel.grad_sync import local


def owners(params: list[torch.Tensor], world: int) -> list[int]:
    """The dp rank that owns each parameter: the largest first, each to the rank holding the fewest
    elements so far (ties: the lower rank), so every rank computes the same assignment."""
    load = [0] * world
    owner = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += params[index].numel()
    return owner


class ZeRO1Muon(Muon):
    """:class:`Muon` over the parameters this dp rank owns; the others' updates arrive by broadcast."""

    def __init__(self, param_groups: list[dict[str, Any]], group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.group_params = [list(g["params"]) for g in param_groups]
        """Every parameter, group by group: what checkpoints number (as a plain optimizer would)."""
        every = [p for params in self.group_params for p in params]
        self.owner_of = dict(zip(map(id, every), owners(every, self.world)))
        owned = [{**g, "params": [p for p in params if self.owner_of[id(p)] == self.rank]}
                 for g, params in zip(param_groups, self.group_params)]
        super().__init__(owned, **kwargs)

    def _every(self) -> list[torch.Tensor]:
        return [p for params in self.group_params for p in params]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        every = self._every()
        for rank in range(self.world):
            params = [local(p) for p in every if self.owner_of[id(p)] == rank]
            if not params:
                continue
            if rank == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            dist.broadcast(flat, group=self.group, group_src=rank)
            if rank != self.rank:
                torch._foreach_copy_(params, [piece.view_as(p) for piece, p in
                                              zip(flat.split([p.numel() for p in params]), params)])
        return loss

    # -- layout-independent checkpoints: each owner writes its parameters' state -------------------
    def _inner_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def sharded_state_dict(self) -> dict[str, Any]:
        """The state of the parameters this rank owns, numbered over every parameter (as a plain
        optimizer's ``state_dict``); the other ranks write the rest."""
        inner = super().state_dict()
        position = {id(p): i for i, p in enumerate(self._every())}
        numbered = [position[id(p)] for p in self._inner_params()]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [position[id(p)] for p in params]}
                  for g, params in zip(inner["param_groups"], self.group_params)]
        return {"state": {numbered[int(i)]: s for i, s in inner["state"].items()}, "param_groups": groups}

    state_dict = sharded_state_dict
    """Also the owners' part only: no rank holds every parameter's state (checkpoints go through
    :func:`~dsl_lit.parallel.optimizer_state.named_optimizer_state`, which writes each part once)."""

    def params_overlapping_shard(self) -> list[torch.Tensor]:
        """The parameters whose saved state this rank reads back: the ones it owns."""
        return [p for p in self._every() if self.owner_of[id(p)] == self.rank]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict numbered over every parameter (from any dp size, with or without
        ZeRO-1): the entries of the parameters this rank owns."""
        for index, (group, params) in enumerate(zip(state_dict["param_groups"], self.group_params)):
            if len(group["params"]) != len(params):
                raise ValueError(f"optimizer param group {index} has {len(group['params'])} params, the model {len(params)}")
        saved = {id(p): state_dict["state"].get(i) for p, i in
                 zip(self._every(), (i for g in state_dict["param_groups"] for i in g["params"]))}
        inner = self._inner_params()
        state = {i: saved[id(p)] for i, p in enumerate(inner) if saved[id(p)]}
        positions = iter(range(len(inner)))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [next(positions) for _ in mine["params"]]}
                  for g, mine in zip(state_dict["param_groups"], self.param_groups)]
        super().load_state_dict({"state": state, "param_groups": groups})
