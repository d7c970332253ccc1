"""``recipes/plan.py``'s Hydra config -> validated model, layout, cluster and options.

The ``model`` and ``parallel`` groups are the training recipes' own, so a plan and a run share
their presets; ``cluster`` and ``plan`` are the planner's.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.scaling.planner.cluster import ClusterConfig
from dsl_lit.scaling.planner.layout import PARALLEL_FIELDS, PlanLayout


@dataclass
class PlanOptions:
    """The ``plan`` node: batch, sequence, precision, recompute, and whether to search layouts."""

    name: str | None = None
    """What the plan calls the model (null: the preset's name), e.g. for a preset reshaped into
    another published model."""
    global_batch_size: int = 2304
    micro_batch_size: int = 1
    seq_len: int = 4096
    precision: str = "bf16"
    recompute: str = "none"
    moments_dtype: str = "fp32"
    ep_overlap: bool | None = None
    """Expert all-to-alls under another micro-batch's compute (null: as the schedule does)."""
    routed_nodes: int | None = None
    """Nodes each token's routed copies reach (null: the model's node-limited routing)."""
    published: bool = False
    """Also plan the published runs and this project's measured steps, and print the comparison."""
    search: bool = False
    search_runnable_only: bool = False
    top_k: int = 5

    def validate(self) -> PlanOptions:
        if self.top_k < 1:
            raise ConfigError(f"plan.top_k={self.top_k} must be >= 1")
        return self


PARALLEL_KEYS = tuple(k for k in PARALLEL_FIELDS if k != "cp")
"""The ``parallel`` keys the planner reads (it plans cp = 1)."""


def plan_inputs(cfg: DictConfig) -> tuple[ModelConfig, PlanLayout, ClusterConfig, PlanOptions]:
    """Validate every group before any estimate is made; errors name the field."""
    raw = typing.cast(dict, OmegaConf.to_container(cfg, resolve=True))
    model_values = dict(raw.get("model") or {})
    if "name" not in model_values:
        raise ConfigError("model.name is missing; pick a preset, e.g. model=deepseek_llm_7b")
    model = ModelConfig.from_name(model_values.pop("name"), **model_values)
    options = dataclass_from_dict(PlanOptions, dict(raw.get("plan") or {}), "plan").validate()
    if options.name:
        model = dataclasses.replace(model, name=options.name)
    cluster = ClusterConfig.from_dict(dict(raw.get("cluster") or {})).validate()
    parallel: dict[str, Any] = dict(raw.get("parallel") or {})
    if int(parallel.pop("cp", 1)) != 1:
        raise ConfigError("parallel.cp > 1: the planner does not model context parallelism yet (its activation "
                          "split and key gathers); plan with parallel.cp=1")
    unknown = sorted(set(parallel) - set(PARALLEL_KEYS))
    if unknown:
        raise ConfigError(f"parallel.{unknown[0]} is not a layout field; known: {list(PARALLEL_KEYS)}")
    tp, pp = int(parallel.get("tp", 1)), int(parallel.get("pp", 1))
    parallel["dp"] = parallel.get("dp") or ParallelLayout.derive_dp(
        cluster.world_size, tp, pp, world=f"the cluster's {cluster.world_size} GPUs")
    layout = PlanLayout.of(**parallel, global_batch_size=options.global_batch_size,
                           micro_batch_size=options.micro_batch_size, seq_len=options.seq_len,
                           precision=options.precision, recompute=options.recompute,
                           moments_dtype=options.moments_dtype, ep_overlap=options.ep_overlap,
                           routed_nodes=options.routed_nodes)
    return model, layout.validate(model, cluster.world_size), cluster, options
