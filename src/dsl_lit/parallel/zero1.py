"""ZeRO-1: AdamW whose fp32 master weights and moments are sharded over the data-parallel group.

Each parameter group (decay / no decay) is cut into buckets of consecutive parameters (in reverse
order, roughly the order backward finishes them); each bucket is flattened into fp32, padded to a
multiple of the dp size and split into dp equal shards. Rank r owns shard r of every bucket: its
master weights and its two Adam moments, so optimizer memory per rank is 1/dp of the total
(DeepSeek LLM section 3.3, DeepSeek-V3 section 3.2). One step is

1. during the step's last backward (after :meth:`arm`), each bucket's gradients are
   reduce-scattered onto their owners asynchronously as soon as the bucket is complete, so the
   communication overlaps the rest of backward (DeepSeek LLM overlaps it the same way);
2. :meth:`reduce_gradients` waits for them (launching any bucket whose hooks did not fire), takes
   the mean over dp and clips by the *global* norm (shard norms all-reduced, in float64);
3. :meth:`step`: AdamW updates the local shards; the shards are all-gathered into every rank's
   model parameters.

``state_dict`` gathers the moments and returns them per original parameter, in the very layout a
plain ``torch.optim.AdamW`` over the model would save, so checkpoints do not depend on the dp size
and load into a run with or without ZeRO-1.

With tensor parallelism the buckets hold each rank's *local* tp shards (ZeRO shards them further
over dp). Tp-sharded and replicated parameters go to separate buckets, so the global norm counts
the former's squares over tp and the latter's once; moments are saved as DTensors (gathered by
the strategy like any tensor-parallel state) and loaded by slicing the full tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from dsl_lit.optim.adamw import AdamW
from dsl_lit.optim.clip import clip_by_norm_, squared_norm
from dsl_lit.parallel.grad_sync import LastBackwardBuckets, local

BUCKET_NUMEL = 4 * 2**20  # 16 MiB of fp32 per bucket: several per model, so some finish early


@dataclass
class _Bucket:
    """Consecutive parameters of one group, flattened: ``padded`` = ``shard_size`` x dp."""

    params: list[torch.Tensor]
    shard_size: int
    padded: int
    master: torch.Tensor  # this rank's fp32 shard; the tensor the inner AdamW updates
    tp_sharded: bool = False  # holds tensor-parallel shards (their squares add up over tp)
    ready: int = 0
    flat: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    work: Any = None


def _flat(tensors: list[torch.Tensor], padded: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(padded, dtype=torch.float32, device=device)
    offset = 0
    for t in tensors:
        t = local(t)
        out[offset : offset + t.numel()] = t.detach().flatten().float()
        offset += t.numel()
    return out


def _is_tp_sharded(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and any(placement.is_shard() for placement in p.placements)


def _chunks(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    chunks: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        if not chunks or size + local(p).numel() > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += local(p).numel()
    return chunks


def _local_part(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's tp slice of a saved full tensor for ``param`` (no communication)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(param, DTensor) and value.shape == param.shape:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return value


class ZeRO1AdamW(LastBackwardBuckets, AdamW):
    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        group: dist.ProcessGroup | None = None,
        bucket_numel: int = BUCKET_NUMEL,
        norm_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ):
        self.group = group
        self.norm_group = norm_group  # pipeline stages: their squared norms add up to the model's
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.group_params = [list(g["params"]) for g in param_groups]
        self.param_index = {id(p): i for i, p in enumerate(p for ps in self.group_params for p in ps)}
        self.buckets: list[_Bucket] = []
        shard_groups = []
        self.tp_group: dist.ProcessGroup | None = None
        for g, params in zip(param_groups, self.group_params):
            masters = []
            for sharded in (False, True):
                kind = [p for p in reversed(params) if _is_tp_sharded(p) == sharded]
                for chunk in _chunks(kind, bucket_numel) if kind else []:
                    shard = math.ceil(sum(local(p).numel() for p in chunk) / self.world)
                    flat = _flat(chunk, shard * self.world, local(chunk[0]).device)
                    master = flat[self.rank * shard : (self.rank + 1) * shard].clone()
                    self.buckets.append(_Bucket(chunk, shard, shard * self.world, master, tp_sharded=sharded))
                    masters.append(master)
                    if sharded:
                        self.tp_group = chunk[0].device_mesh.get_group()
            shard_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": masters})
        super().__init__(shard_groups, **kwargs)
        self._bucket_of_master = {id(b.master): b for b in self.buckets}
        self._install_hooks()

    def _params(self) -> list[torch.Tensor]:
        return [p for b in self.buckets for p in b.params]

    # -- gradients: reduce-scatter overlapped with the last backward (hooks: LastBackwardBuckets) ---
    def _launch(self, b: _Bucket) -> None:
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in b.params]
        b.flat = _flat(grads, b.padded, b.master.device)
        b.grad = torch.empty_like(b.master)
        b.work = dist.reduce_scatter_tensor(b.grad, b.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    @torch.no_grad()
    def reduce_gradients(self, max_norm: float | None, loss_scale: float = 1.0) -> torch.Tensor:
        """Finish the mean of the accumulated gradients over dp onto the local shards; clip by the
        global norm. Returns the global gradient norm before clipping (as ``clip_grad_norm_``)."""
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
            b.master.grad = b.grad.div_(self.world)
            b.flat = b.grad = b.work = None
        self.armed = False
        shards = [b.master.grad for b in self.buckets]
        replicated = squared_norm([b.master.grad for b in self.buckets if not b.tp_sharded])
        sharded = squared_norm([b.master.grad for b in self.buckets if b.tp_sharded])
        parts = torch.stack([replicated, sharded]).to(shards[0].device)
        dist.all_reduce(parts, group=self.group)
        if self.tp_group is not None:  # tp shards hold different numbers; replicated ones the same
            dist.all_reduce(parts[1:], group=self.tp_group)
        square = parts.sum()
        if self.norm_group is not None:
            dist.all_reduce(square, group=self.norm_group)
        norm = clip_by_norm_(shards, square.sqrt(), max_norm, loss_scale)
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
                shard = local(p)
                shard.copy_(full[offset : offset + shard.numel()].view_as(shard))
                offset += shard.numel()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self._params():
            p.grad = None

    # -- layout-independent checkpoints ------------------------------------------------------------
    def _extents(self, bucket: _Bucket) -> list[tuple[torch.Tensor, int, int]]:
        """(parameter, start, end) of each parameter in its bucket's flat buffer (local tp shards)."""
        out, offset = [], 0
        for p in bucket.params:
            out.append((p, offset, offset + local(p).numel()))
            offset += local(p).numel()
        return out

    def _owns(self, bucket: _Bucket, start: int) -> bool:
        """Each parameter belongs to the rank whose shard holds its first element."""
        return start // bucket.shard_size == self.rank

    def _gather(self, shard: torch.Tensor, bucket: _Bucket, owned_only: bool = False) -> dict[int, torch.Tensor]:
        """The whole moment of the bucket's parameters (of this rank's own ones with ``owned_only``),
        by position in the bucket; tp-sharded ones as DTensors, so checkpoints store their pieces."""
        full = torch.empty(bucket.padded, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group)
        out = {}
        for i, (p, start, end) in enumerate(self._extents(bucket)):
            if owned_only and not self._owns(bucket, start):
                continue
            value = full[start:end].view_as(local(p)).clone()
            if isinstance(p, DTensor):
                value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
            out[i] = value
        return out

    def _masters(self) -> list[torch.Tensor]:
        return [m for g in self.param_groups for m in g["params"]]

    def state_dict(self, owned_only: bool = False) -> dict[str, Any]:
        """A plain AdamW state dict over the model's parameters (a collective: call on every rank).
        With ``owned_only`` each rank returns the moments of the parameters it owns (1/dp of them),
        so a sharded checkpoint writer stores every moment once and no rank holds them all."""
        inner = super().state_dict()
        state: dict[int, dict[str, Any]] = {}
        for index, master in enumerate(self._masters()):
            shard_state = inner["state"].get(index)
            if not shard_state:
                continue
            bucket = self._bucket_of_master[id(master)]
            moments = {k: self._gather(shard_state[k], bucket, owned_only) for k in ("exp_avg", "exp_avg_sq")}
            for i in moments["exp_avg"]:
                state[self.param_index[id(bucket.params[i])]] = {
                    "step": shard_state["step"].clone(), **{k: v[i] for k, v in moments.items()}
                }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [self.param_index[id(p)] for p in params]}
            for g, params in zip(inner["param_groups"], self.group_params)
        ]
        return {"state": state, "param_groups": groups}

    def sharded_state_dict(self) -> dict[str, Any]:
        return self.state_dict(owned_only=True)

    def params_overlapping_shard(self) -> list[torch.Tensor]:
        """The parameters whose saved moments this rank needs to rebuild its shards."""
        lo_hi = [(b, self.rank * b.shard_size, (self.rank + 1) * b.shard_size) for b in self.buckets]
        needed = {id(p) for b, lo, hi in lo_hi for p, start, end in self._extents(b) if start < hi and end > lo}
        return [p for p in self._params_in_order() if id(p) in needed]

    def _params_in_order(self) -> list[torch.Tensor]:
        return [p for params in self.group_params for p in params]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain AdamW state dict (from any dp size, with or without ZeRO-1): cut our shards
        out of the moments of the parameters overlapping them (the others may be absent)."""
        for group_index, (group, params) in enumerate(zip(state_dict["param_groups"], self.group_params)):
            if len(group["params"]) != len(params):
                raise ValueError(f"optimizer param group {group_index} has {len(group['params'])} params, "
                                 f"the model {len(params)}")
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        saved_state = {id(p): state_dict["state"].get(pid) for p, pid in zip(self._params_in_order(), saved_ids)}
        state: dict[int, dict[str, Any]] = {}
        for index, master in enumerate(self._masters()):
            bucket = self._bucket_of_master[id(master)]
            lo, hi = self.rank * bucket.shard_size, (self.rank + 1) * bucket.shard_size
            overlapping = [(p, start, end) for p, start, end in self._extents(bucket) if start < hi and end > lo]
            saved = [saved_state[id(p)] for p, _, _ in overlapping]
            if not overlapping or not all(saved):
                continue  # no state saved yet (a checkpoint from before the first step)
            shard_state = {"step": torch.as_tensor(saved[0]["step"]).clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                values = torch.zeros_like(master)
                for (p, start, end), moments in zip(overlapping, saved):
                    flat = _local_part(moments[key], p).flatten().to(master.device, torch.float32)
                    a, b = max(start, lo), min(end, hi)
                    values[a - lo : b - lo] = flat[a - start : b - start]
                shard_state[key] = values
            state[index] = shard_state
        masters = iter(range(len(self._masters())))
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [next(masters) for _ in inner["params"]]}
            for g, inner in zip(state_dict["param_groups"], self.param_groups)
        ]
        super().load_state_dict({"state": state, "param_groups": groups})
        self.refresh_masters()

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Cut the fp32 master shards anew from the parameters. Restoring a checkpoint loads the
        model's weights after this optimizer was built (and before its state): without this, the
        next all-gather would write the weights of the moment of construction back."""
        for b in self.buckets:
            flat = _flat(b.params, b.padded, b.master.device)
            b.master.copy_(flat[self.rank * b.shard_size : (self.rank + 1) * b.shard_size])

    def state_numel(self) -> int:
        """Numbers this rank holds for the optimizer: fp32 master shards plus both moments."""
        moments = sum(t.numel() for s in self.state.values() for k, t in s.items() if k != "step")
        return moments + sum(b.master.numel() for b in self.buckets)
