"""The layout a plan is made for, and its checks.

It holds the ``parallel`` group's layout (a :class:`ParallelLayout`: dp/tp/pp/ep/cp, ZeRO-1,
schedule, virtual stages, world size) plus what the planner also needs from other groups: batch and sequence sizes (``data``), recompute
(``memory``), precision and AdamW's moment dtype. Two schedules exist on paper only: ``ZB1P``
(zero-bubble 1F1B) and ``DualPipe`` (DeepSeek-V3's bidirectional pipeline, two copies of the
weights); our runtime runs ``DualPipeV``, DualPipe cut in half. Every schedule is a row of
:mod:`dsl_lit.config.pipeline_schedules`, the table the runtime reads too. :meth:`PlanLayout.runtime_issue`
says whether dsl-lit itself could run a layout, without stopping the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.memory import MODES
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.optim import OPTIMIZER_NAMES
from dsl_lit.config.parallel import (
    ParallelConfig,
    ParallelLayout,
    check_ep_over_dp,
    check_heads,
    check_world_size,
)
from dsl_lit.config.pipeline_schedules import RUNNABLE, SCHEDULE_TABLE, schedule

SCHEDULES = tuple(SCHEDULE_TABLE)
"""Every row of :data:`~dsl_lit.config.pipeline_schedules.SCHEDULE_TABLE`: the runtime's and the planned-only ones."""
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
V3_RECIPE = "deepseek_v3"
"""The recompute mode named after DeepSeek-V3's own recipe (sections 3.2.3 and 3.3.2), planned
only: norms, MLA up-projections and SwiGLU outputs recomputed, and under FP8 the cached linear
inputs kept in FP8 (see :func:`dsl_lit.scaling.planner.memory.deepseek_v3_activations`). A recipe's
name, not a model family: ``plan.recompute=deepseek_v3`` plans any model with it."""
RECOMPUTE_MODES = (*MODES, V3_RECIPE)
"""The runtime's modes, plus :data:`V3_RECIPE`."""


PARALLEL_FIELDS = ("dp", "tp", "pp", "ep", "cp", "zero1", "pp_schedule", "pp_virtual_stages", "sequence_parallel")
"""The fields of :class:`PlanLayout` that belong to its :class:`ParallelLayout`."""


@dataclass(frozen=True)
class PlanLayout:
    """A :class:`ParallelLayout` (the degrees, world size and mesh; its ``pp_schedule`` may also be
    one of the planned-only :data:`SCHEDULES`) plus what the planner needs from other groups."""

    parallel: ParallelLayout
    micro_batch_size: int = 1
    global_batch_size: int = 1
    """Sequences per optimizer step over all data-parallel ranks."""
    seq_len: int = 4096
    recompute: str = "none"
    """One of :data:`RECOMPUTE_MODES`."""
    precision: str = "bf16"
    """Matmul precision: fp32 | bf16 | fp16 | fp8 (DeepSeek-V3's FP8 GEMMs inside bf16 training)."""
    moments_dtype: str = "fp32"
    optimizer: str = "adamw"
    """``optim.name``: AdamW keeps two moments per parameter, Muon one momentum per matrix (its
    AdamW-stepped embeddings and head, under 0.5% of DeepSeek-V3's parameters, are counted at one too)."""
    ep_overlap: bool | None = None
    """Whether a micro-batch's expert all-to-alls run under another micro-batch's compute (None: the
    schedule decides, as DualPipe and DualPipeV do; True for other schedules is Megatron-Core's
    ``overlap_moe_expert_parallel_comm``, its 1F1B all-to-all overlap)."""

    routed_nodes: int | None = None
    """Nodes each token's routed copies go to over InfiniBand (None: the model's node-limited
    routing, ``n_limited_groups`` when its groups are the EP nodes, else up to k). A benchmark's
    balanced stand-in router may send fewer (NeMo AutoModel's: one)."""

    @classmethod
    def of(cls, *, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, zero1: bool = True,
           pp_schedule: str = "1F1B", pp_virtual_stages: int = 1, sequence_parallel: bool = False,
           **extras: Any) -> PlanLayout:
        """The layout of these degrees on the ``dp x tp x pp x cp`` GPUs they fill (ZeRO-1 on unless
        said otherwise), with the planner's ``extras`` (batch, sequence, recompute, precision, moments)."""
        parallel = ParallelLayout(world_size=dp * tp * pp * cp, dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, zero1=zero1,
                                  sequence_parallel=sequence_parallel, pp_schedule=pp_schedule,
                                  pp_virtual_stages=pp_virtual_stages)
        return cls(parallel, **extras)

    def replace(self, **changes: Any) -> PlanLayout:
        """A copy with ``changes``, degrees (:data:`PARALLEL_FIELDS`) and planner fields alike."""
        degrees = {k: changes.pop(k) for k in PARALLEL_FIELDS if k in changes}
        if degrees:
            kept = {k: getattr(self.parallel, k) for k in PARALLEL_FIELDS}
            changes["parallel"] = PlanLayout.of(**{**kept, **degrees}).parallel
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The degrees (cp left out: the planner plans cp = 1) and the planner's fields, flat."""
        degrees = {k: getattr(self.parallel, k) for k in PARALLEL_FIELDS if k != "cp"}
        extras = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "parallel"}
        return {**degrees, **extras}

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks one pp rank runs: 2 for the V and DualPipe's two directions."""
        parallel = self.parallel
        if parallel.pp == 1:
            return 1
        return schedule(parallel.pp_schedule).chunks_per_rank(parallel.pp_virtual_stages)

    @property
    def overlaps_all_to_all(self) -> bool:
        """Whether the expert all-to-alls hide under the paired micro-batch's compute (see :attr:`ep_overlap`)."""
        if self.parallel.ep == 1:
            return False
        if self.ep_overlap is not None:
            return self.ep_overlap
        return self.parallel.pp > 1 and schedule(self.parallel.pp_schedule).overlaps_all_to_all

    @property
    def n_stages(self) -> int:
        """Distinct stages the layers are cut into (DualPipe's two directions share theirs)."""
        pp = self.parallel.pp
        return pp if schedule(self.parallel.pp_schedule).copies_per_stage > 1 else pp * self.chunks_per_rank

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per step."""
        return self.parallel.micro_batches_per_step(self.global_batch_size, self.micro_batch_size)

    def validate(self, model: ModelConfig, world_size: int | None = None) -> PlanLayout:
        """Structural checks only (the sizes must divide); runtime support is :meth:`runtime_issue`."""
        parallel = self.parallel
        for owner, name in (*((parallel, n) for n in ("dp", "tp", "pp", "ep", "cp", "pp_virtual_stages")),
                            *((self, n) for n in ("micro_batch_size", "global_batch_size", "seq_len"))):
            value = getattr(owner, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"plan layout: {name}={value!r} must be a positive integer")
        dp, tp, pp, ep = parallel.dp, parallel.tp, parallel.pp, parallel.ep
        if world_size is not None:
            check_world_size(dp, tp, pp, parallel.cp, world_size, world="the cluster's GPUs (cluster.nodes x "
                             "cluster.gpus_per_node)", fix="set parallel.dp=null to fill it")
        if parallel.pp_schedule not in SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule!r} is unknown to the planner; "
                              f"choose one of {SCHEDULES}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"plan.recompute={self.recompute!r} is unknown; choose one of {list(RECOMPUTE_MODES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"plan precision {self.precision!r} is unknown; choose one of {PRECISIONS}")
        if self.routed_nodes is not None and (not isinstance(self.routed_nodes, int) or self.routed_nodes < 1):
            raise ConfigError(f"plan.routed_nodes={self.routed_nodes!r} must be null or a positive integer")
        if self.moments_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"optim.moments_dtype={self.moments_dtype!r} must be fp32 or bf16")
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ConfigError(f"optim.name={self.optimizer!r} is not one of {list(OPTIMIZER_NAMES)}")
        if self.global_batch_size % (dp * self.micro_batch_size):
            raise ConfigError(
                f"data.global_batch_size={self.global_batch_size} must be a multiple of data.micro_batch_size="
                f"{self.micro_batch_size} x dp={dp}"
            )
        check_heads(model, tp)
        if self.n_stages > model.n_layers:
            raise ConfigError(f"{self.n_stages} pipeline stages exceed model.n_layers={model.n_layers}; lower parallel.pp")
        if ep > 1:
            if not model.is_moe or model.n_routed_experts % ep:
                raise ConfigError(f"parallel.ep={ep} must divide model.n_routed_experts={model.n_routed_experts}")
            check_ep_over_dp(ep, dp)
        if pp > 1 and self.micro_batches < pp:
            raise ConfigError(
                f"{self.micro_batches} micro-batches per step leave a pipeline of parallel.pp={pp} stages idle; "
                "raise data.global_batch_size or lower data.micro_batch_size"
            )
        return self

    def runtime_issue(self, model: ModelConfig) -> str | None:
        """Why dsl-lit's own runtime could not run this layout (None: it could)."""
        row = schedule(self.parallel.pp_schedule)
        if not row.runs:
            return f"parallel.pp_schedule={row.name} is planned only; dsl-lit runs {', '.join(RUNNABLE)}"
        if self.recompute not in MODES:
            return f"plan.recompute={self.recompute} is planned only; dsl-lit's memory.recompute runs {list(MODES)}"
        if self.ep_overlap and not row.overlaps_all_to_all:
            overlapping = ", ".join(name for name in RUNNABLE if schedule(name).overlaps_all_to_all)
            return f"plan.ep_overlap=true under {row.name} is planned only; dsl-lit overlaps the all-to-alls in {overlapping}"
        layout = self.parallel
        if self.precision == "fp8" and layout.tp > 1:
            return "FP8 linears do not take tensor-parallel weights yet"
        parallel = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, ep=layout.ep, cp=layout.cp,
                                  zero1=layout.zero1, sequence_parallel=layout.sequence_parallel,
                                  pp_schedule=layout.pp_schedule,
                                  pp_virtual_stages=layout.pp_virtual_stages if layout.pp > 1 else 1)
        try:
            ParallelLayout.create(parallel, model, layout.world_size)
        except ConfigError as error:
            return str(error)
        return None
