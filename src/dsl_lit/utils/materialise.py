"""Giving memory to a model built on the meta device, after the layout has cut it down.

Why: a model too big for one process is built on the meta device (shapes only), pruned to this
rank's pipeline stages and sharded by tensor and expert parallelism, all without memory; only then
is each tensor this rank holds allocated, and a checkpoint reader fills it with its region of the
full tensor (:mod:`dsl_lit.hf.reader`, or DCP for our own checkpoints). No rank ever holds the
whole model, and nothing is broadcast.

:func:`materialise` allocates (``to_empty``; DTensor shards stay DTensors, tied weights are tied
again), recomputes the non-persistent buffers (RoPE tables, expert
load counters) and returns, for every state-dict tensor, the local tensor to fill and where it
sits in the full tensor. Gradient hooks must be registered after it (``to_empty`` swaps the
tensors they hang on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dsl_lit.utils.names import few

Target = tuple[torch.Tensor, tuple[int, ...]]
"""A tensor to fill (a process's local shard) and the offset of its first element in the full tensor."""


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is still on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one shared tensor (e.g. a tied output head and embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, groups: Iterable[list[str]]) -> None:
    """Share each group's parameter again (``load_state_dict(assign=True)`` and ``to_empty`` off the
    meta device give each name its own Parameter)."""
    for names in groups:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)


def local_target(tensor: torch.Tensor) -> Target:
    """This process's part of ``tensor`` (a DTensor's local shard, or the tensor itself) and its
    offset in the full tensor."""
    if isinstance(tensor, DTensor):
        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(offsets)
    return tensor, (0,) * tensor.ndim


def _cast_on_meta(model: nn.Module, dtype_of: Callable[[str], torch.dtype | None]) -> None:
    """Give each meta state-dict tensor the dtype ``dtype_of(name)`` asks (None: as built), before
    any memory exists: new Parameters (a DTensor's ``.data`` cannot change dtype), so tied ones
    must be tied again afterwards."""
    persistent = set(model.state_dict(keep_vars=True))
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, param in list(module.named_parameters(recurse=False)):
            want = dtype_of(dot + name)
            if want is not None and param.dtype != want:
                module.register_parameter(name, nn.Parameter(param.detach().to(want), param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            want = dtype_of(dot + name) if dot + name in persistent else None
            if want is not None and buffer.dtype != want:
                module.register_buffer(name, buffer.to(want))


def recompute_buffers(model: nn.Module, device: torch.device | None = None) -> None:
    """Recompute the buffers that are in no checkpoint (non-persistent: RoPE tables, load counters),
    allocating them on ``device`` first if given: ``reset_parameters`` of their modules, which own
    no parameter, so nothing loaded is overwritten."""
    persistent = set(model.state_dict(keep_vars=True))
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if all(dot + n in persistent for n, _ in module.named_buffers(recurse=False)):
            continue
        if any(True for _ in module.parameters(recurse=False)) or not hasattr(module, "reset_parameters"):
            raise RuntimeError(
                f"module {prefix or type(module).__name__!r} has buffers outside the state dict that cannot be "
                "recomputed in isolation (it owns parameters or has no reset_parameters)"
            )
        if device is not None:
            module.to_empty(device=device, recurse=False)
        module.reset_parameters()


def check_materialised(model: nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {few(left)}")


@torch.no_grad()
def materialise(
    model: nn.Module, device: torch.device | str, dtype_of: Callable[[str], torch.dtype | None] | None = None
) -> dict[str, Target]:
    """Allocate every tensor of a meta-device ``model`` (already pruned and sharded) on ``device``
    (uninitialised; dtypes from ``dtype_of`` where it names one) and recompute its non-persistent
    buffers. Returns state-dict name -> :data:`Target` for everything a checkpoint must fill; a
    tensor under several names (a tied head) is listed once, under its first name."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tied = tied_groups(model)
    if dtype_of is not None:
        _cast_on_meta(model, dtype_of)
    model.to_empty(device=device)
    retie(model, tied)
    recompute_buffers(model)
    check_materialised(model)
    targets: dict[str, Target] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            targets[name] = local_target(tensor)
    return targets
