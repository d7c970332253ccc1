"""ZeRO-1: AdamW whose fp32 master weights and moments are sharded over the data-parallel group.

Each parameter group (decay / no decay) is flattened into one fp32 buffer, padded to a multiple
of the dp size and cut into dp equal shards; rank r owns shard r: its master weights and its two
Adam moments, so optimizer memory per rank is 1/dp of the total (DeepSeek LLM section 3.3,
DeepSeek-V3 section 3.2). One step is

1. :meth:`reduce_gradients`: the gradients each rank accumulated over its micro-batches are
   reduce-scattered (mean over dp) straight onto the owner's shard, and clipped by the *global*
   norm (shard norms all-reduced), exactly as ``clip_grad_norm_`` would on the full gradient;
2. :meth:`step`: AdamW updates the local shard; the updated shards are all-gathered into every
   rank's model parameters.

``state_dict`` gathers the moments and returns them per original parameter, in the very layout a
plain ``torch.optim.AdamW`` over the model would save, so checkpoints do not depend on the dp size
and load into a run with or without ZeRO-1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsl_lit.optim.clip import clip_by_norm_, squared_norm


@dataclass
class _Bucket:
    """One parameter group flattened: ``padded`` = ``shard_size`` x dp >= ``numel``."""

    params: list[torch.Tensor]
    numel: int
    shard_size: int
    padded: int
    master: torch.Tensor  # this rank's fp32 shard; the tensor the inner AdamW updates


def _flat(tensors: list[torch.Tensor], padded: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(padded, dtype=torch.float32, device=device)
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()] = t.detach().flatten().float()
        offset += t.numel()
    return out


class ZeRO1AdamW(torch.optim.AdamW):
    def __init__(self, param_groups: list[dict[str, Any]], group: dist.ProcessGroup | None = None, **kwargs: Any):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.buckets: list[_Bucket] = []
        shard_groups = []
        for g in param_groups:
            params = list(g["params"])
            device = params[0].device if params else torch.device("cpu")
            numel = sum(p.numel() for p in params)
            shard = math.ceil(numel / self.world)
            flat = _flat(params, shard * self.world, device)
            master = flat[self.rank * shard : (self.rank + 1) * shard].clone()
            self.buckets.append(_Bucket(params, numel, shard, shard * self.world, master))
            shard_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [master]})
        super().__init__(shard_groups, **kwargs)

    def _params(self) -> list[torch.Tensor]:
        return [p for b in self.buckets for p in b.params]

    @torch.no_grad()
    def reduce_gradients(self, max_norm: float | None) -> torch.Tensor:
        """Mean the accumulated gradients over dp onto the local shards; clip by the global norm.

        Returns the global gradient norm before clipping (what ``clip_grad_norm_`` returns)."""
        for b in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            flat = _flat(grads, b.padded, b.master.device)
            shard = torch.empty_like(b.master)
            dist.reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.SUM, group=self.group)
            b.master.grad = shard.div_(self.world)
        shards = [b.master.grad for b in self.buckets]
        square = squared_norm(shards).to(shards[0].device)
        dist.all_reduce(square, group=self.group)
        norm = clip_by_norm_(shards, square.sqrt(), max_norm)
        for p in self._params():
            p.grad = None  # the full-size gradients are no longer needed
        return norm

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for b in self.buckets:
            full = torch.empty(b.padded, dtype=torch.float32, device=b.master.device)
            dist.all_gather_into_tensor(full, b.master, group=self.group)
            offset = 0
            for p in b.params:
                p.copy_(full[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self._params():
            p.grad = None

    # -- layout-independent checkpoints ------------------------------------------------------------
    def _gather(self, shard: torch.Tensor, bucket: _Bucket) -> list[torch.Tensor]:
        full = torch.empty(bucket.padded, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group)
        out, offset = [], 0
        for p in bucket.params:
            out.append(full[offset : offset + p.numel()].view_as(p).clone())
            offset += p.numel()
        return out

    def state_dict(self) -> dict[str, Any]:
        """A plain AdamW state dict over the model's parameters (a collective: call on every rank)."""
        inner = super().state_dict()
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for bucket, group in zip(self.buckets, inner["param_groups"]):
            shard_state = inner["state"].get(group["params"][0])
            ids = list(range(index, index + len(bucket.params)))
            if shard_state:
                moments = {k: self._gather(shard_state[k], bucket) for k in ("exp_avg", "exp_avg_sq")}
                for i, pid in enumerate(ids):
                    state[pid] = {"step": shard_state["step"].clone(), **{k: v[i] for k, v in moments.items()}}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
            index += len(ids)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain AdamW state dict (from any dp size, with or without ZeRO-1): keep our shard."""
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for group_index, (bucket, group) in enumerate(zip(self.buckets, state_dict["param_groups"])):
            ids = group["params"]
            if len(ids) != len(bucket.params):
                raise ValueError(f"optimizer param group {group_index} has {len(ids)} params, the model {len(bucket.params)}")
            per_param = [state_dict["state"].get(pid) for pid in ids]
            if per_param and all(s is not None for s in per_param):
                shard_state = {"step": torch.as_tensor(per_param[0]["step"]).clone()}
                lo, hi = self.rank * bucket.shard_size, (self.rank + 1) * bucket.shard_size
                for key in ("exp_avg", "exp_avg_sq"):
                    flat = _flat([s[key] for s in per_param], bucket.padded, bucket.master.device)
                    shard_state[key] = flat[lo:hi].clone()
                state[group_index] = shard_state
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [group_index]})
        super().load_state_dict({"state": state, "param_groups": groups})

    def state_numel(self) -> int:
        """Numbers this rank holds for the optimizer: fp32 master shards plus both moments."""
        moments = sum(t.numel() for s in self.state.values() for k, t in s.items() if k != "step")
        return moments + sum(b.master.numel() for b in self.buckets)
