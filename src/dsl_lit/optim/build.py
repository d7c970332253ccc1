"""The optimizer an ``optim`` config names, over a model's parameter groups: one table, the same
keyword arguments for the plain and the ZeRO-1 forms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dsl_lit.config.optim import OptimConfig
from dsl_lit.optim.adamw import MOMENT_DTYPES, AdamW, param_groups
from dsl_lit.optim.muon import Muon, muon_param_groups


def uses_fused_kernel(cfg: OptimConfig, params_of_one_kind: bool = True) -> bool:
    """``optim.fused``, or where it is null: the fused kernel wherever it applies (AdamW with fp32
    moments, ``optim.foreach`` unset, and each param group all plain tensors or all DTensors: the
    kernel refuses a mix, which expert parallelism makes of a group by sharding only the experts).
    Muon never: its matrices have no fused kernel, and a step skipped on the device
    (``found_inf``) must skip them too."""
    if cfg.name == "muon":
        return False
    if cfg.fused is not None:
        return cfg.fused
    return cfg.moments_dtype == "fp32" and cfg.foreach is None and params_of_one_kind


def adamw_arguments(cfg: OptimConfig, params_of_one_kind: bool = True) -> dict[str, Any]:
    """:class:`AdamW`'s keyword arguments from the ``optim`` group (its ZeRO-1 form takes the same)."""
    return dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=cfg.foreach,
                fused=uses_fused_kernel(cfg, params_of_one_kind) or None,
                moments_dtype=MOMENT_DTYPES[cfg.moments_dtype])


def muon_arguments(cfg: OptimConfig, params_of_one_kind: bool = True) -> dict[str, Any]:
    """:class:`Muon`'s: AdamW's (for the embeddings, the head and 1-D parameters) and Muon's own."""
    return dict(adamw_arguments(cfg, params_of_one_kind), momentum=cfg.momentum, nesterov=cfg.nesterov,
                ns_steps=cfg.ns_steps, lr_adjust=cfg.lr_adjust)


class OptimizerKind:
    """One ``optim.name``: how it groups a model's parameters and the optimizer's arguments."""

    def __init__(self, optimizer: type[AdamW], groups: Callable[[nn.Module, float], list[dict]],
                 arguments: Callable[[OptimConfig, bool], dict[str, Any]]) -> None:
        self.optimizer, self.groups, self.arguments = optimizer, groups, arguments


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind(AdamW, param_groups, adamw_arguments),
    "muon": OptimizerKind(Muon, muon_param_groups, muon_arguments),
}
"""``optim.name`` -> its optimizer (``dsl_lit.config.optim.OPTIMIZER_NAMES`` lists the same names;
a test ties them)."""


def optimizer_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    return OPTIMIZERS[cfg.name].groups(model, cfg.weight_decay)


def optimizer_arguments(cfg: OptimConfig, groups: list[dict]) -> dict[str, Any]:
    one_kind = all(len({isinstance(p, DTensor) for p in g["params"]}) <= 1 for g in groups)
    return OPTIMIZERS[cfg.name].arguments(cfg, one_kind)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = optimizer_groups(model, cfg)
    return OPTIMIZERS[cfg.name].optimizer(groups, **optimizer_arguments(cfg, groups))
