"""Layout-independent optimizer checkpoints: optimizer state keyed by parameter name.

A ``torch.optim`` state dict numbers parameters by their position in the optimizer's groups. On a
pipeline stage the optimizer holds only that stage's parameters, and ZeRO-1 steps flat shards, so
position 3 means a different tensor in every layout. Checkpoints therefore key each parameter's
moments by its name in the LightningModule (``model.layers.0.attention.wq.weight``), the same name
its weights have; tensor-parallel moments stay DTensors, so the sharded checkpoint writer stores
their pieces and any other layout reads back the pieces it holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model parameters in the order the optimizer's ``state_dict`` numbers them (ZeRO-1 steps
    flat shards but numbers the parameters they were cut from, ``group_params``)."""
    groups = getattr(optimizer, "group_params", None) or [g["params"] for g in optimizer.param_groups]
    return [p for group in groups for p in group]


def params_with_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters whose saved moments this rank reads back: all of them, or under ZeRO-1 those
    overlapping its shards."""
    overlapping = getattr(optimizer, "params_overlapping_shard", None)
    return overlapping() if overlapping is not None else optimizer_params(optimizer)


def _names(optimizer: torch.optim.Optimizer, module: nn.Module, params: list[torch.Tensor] | None = None) -> list[str]:
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [name_of[id(p)] for p in (optimizer_params(optimizer) if params is None else params)]


def named_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names for positions. Under ZeRO-1 (a collective)
    each rank returns the moments of the parameters it owns, so no rank gathers them all."""
    state = getattr(optimizer, "sharded_state_dict", optimizer.state_dict)()
    names = _names(optimizer, module)
    named = {names[int(i)]: dict(per_param) for i, per_param in state["state"].items()}
    # A parameter no loss has reached yet (DeepSeek-V4's CSA indexer, an indexer under
    # index_training=off) has no state: its untouched template is saved, so that a resume finds every
    # parameter's state; step 0 and zero moments are what the optimizer creates on a first gradient.
    # (Not under ZeRO-1: each rank returns the parameters it owns, and a template filled in for one
    # owned elsewhere would overwrite that rank's moments in the checkpoint.)
    if named and not hasattr(optimizer, "sharded_state_dict"):
        owned = optimizer_params(optimizer)
        for name, param in zip(_names(optimizer, module, owned), owned):
            if name not in named:
                named[name] = optimizer.state_template(param)
    return {
        "state": named,
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[int(i)] for i in g["params"]]}
            for g in state["param_groups"]
        ],
    }


def optimizer_state_template(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """Zeroed state for every parameter whose state this rank reads back, shaped and placed like the
    parameter, as the optimizer keeps it (``state_template``: AdamW's moments, Muon's momentum):
    what a sharded checkpoint is read into (the optimizer may have no state yet)."""
    params = params_with_state(optimizer)
    state = {name: optimizer.state_template(param) for name, param in zip(_names(optimizer, module, params), params)}
    return {"state": state, "param_groups": []}


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, named: dict[str, Any]) -> None:
    """Load a named state (saved under any layout) into this rank's optimizer: the moments of the
    parameters it holds, the hyperparameters of each group (the groups are the same everywhere)."""
    names = _names(optimizer, module)
    groups = getattr(optimizer, "group_params", None) or [g["params"] for g in optimizer.param_groups]
    saved_groups = named["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this run's {len(groups)}")
    needed = _names(optimizer, module, params_with_state(optimizer))
    missing = [n for n in needed if not named["state"].get(n)]
    if missing and len(missing) < len(needed):  # all missing: saved before the first step
        raise KeyError(f"the checkpoint has no optimizer state for {', '.join(missing[:5])}")
    positional_groups, start = [], 0
    for saved, params in zip(saved_groups, groups):
        positional_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                                  "params": list(range(start, start + len(params)))})
        start += len(params)
    state = {i: named["state"][n] for i, n in enumerate(names) if named["state"].get(n)}
    optimizer.load_state_dict({"state": state, "param_groups": positional_groups})
