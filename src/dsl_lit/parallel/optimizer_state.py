"""Layout-independent optimizer checkpoints: AdamW state indexed as one process would index it.

A ``torch.optim`` state dict numbers parameters by their position in the optimizer's groups. On
a pipeline stage the optimizer holds only that stage's parameters, so position 3 means a
different tensor on every stage. Before saving, each stage's entries are renumbered by parameter
name into the order a single process uses (``param_groups`` of the full model) and the stages'
parts are merged; after loading, the inverse picks this stage's entries. A checkpoint therefore
looks the same whatever the layout, and any layout can resume it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.optim.adamw import param_groups


def optimizer_param_names(model: nn.Module) -> list[list[str]]:
    """Parameter names per optimizer group, in the order ``param_groups`` puts them."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in param_groups(model, 0.0)]


def full_model_param_names(cfg: ModelConfig) -> list[list[str]]:
    """The same for the whole, unsplit model (built on the meta device: no memory)."""
    with torch.device("meta"):
        return optimizer_param_names(build_model(cfg))


def to_full_order(state: dict[str, Any], local: list[list[str]], full: list[list[str]]) -> dict[str, Any]:
    """Renumber a stage's optimizer state dict from its own positions to the full model's."""
    position = {name: i for i, name in enumerate(n for group in full for n in group)}
    local_flat = [n for group in local for n in group]
    renumbered = {position[local_flat[int(i)]]: v for i, v in state.get("state", {}).items()}
    groups = [
        {**group, "params": [position[n] for n in names]}
        for group, names in zip(state["param_groups"], local)
    ]
    return {"state": renumbered, "param_groups": groups}


def merge_stages(parts: list[dict[str, Any]], full: list[list[str]]) -> dict[str, Any]:
    """One state dict from every stage's renumbered part (each parameter lives on one stage)."""
    state: dict[int, Any] = {}
    for part in parts:
        state.update(part["state"])
    groups = []
    start = 0
    for index, names in enumerate(full):
        hyper = {k: v for k, v in parts[0]["param_groups"][index].items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def to_stage_order(state: dict[str, Any], local: list[list[str]], full: list[list[str]]) -> dict[str, Any]:
    """This stage's entries of a full-order state dict, numbered as its optimizer numbers them."""
    full_flat = [n for group in full for n in group]
    local_position = {name: i for i, name in enumerate(n for group in local for n in group)}
    picked = {
        local_position[full_flat[int(i)]]: v
        for i, v in state.get("state", {}).items()
        if full_flat[int(i)] in local_position
    }
    groups = []
    start = 0
    for group, names in zip(state["param_groups"], local):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": picked, "param_groups": groups}
