"""The layout a plan is made for, and its checks.

It is the ``parallel`` group's layout (dp/tp/pp/ep, ZeRO-1, schedule, virtual stages) plus what the
planner also needs from other groups: batch and sequence sizes (``data``), recompute
(``memory``), precision and AdamW's moment dtype. Two schedules exist on paper only: ``ZB1P``
(zero-bubble 1F1B) and ``DualPipe`` (DeepSeek-V3's bidirectional pipeline, two copies of the
weights); our runtime runs ``DualPipeV``, DualPipe cut in half. :meth:`PlanLayout.runtime_issue`
says whether dsl-lit itself could run a layout, without stopping the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsl_lit.config.errors import ConfigError
from dsl_lit.config.memory import MODES
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.parallel import ParallelConfig, ParallelLayout

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZB1P", "DualPipe", "DualPipeV")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
V3_RECIPE = "deepseek_v3"
"""The recompute mode named after DeepSeek-V3's own recipe (sections 3.2.3 and 3.3.2), planned
only: norms, MLA up-projections and SwiGLU outputs recomputed, and under FP8 the cached linear
inputs kept in FP8 (see :func:`dsl_lit.scaling.planner.memory.deepseek_v3_activations`). A recipe's
name, not a model family: ``plan.recompute=deepseek_v3`` plans any model with it."""
RECOMPUTE_MODES = (*MODES, V3_RECIPE)
"""The runtime's modes, plus :data:`V3_RECIPE`."""


@dataclass
class PlanLayout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero1: bool = True
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    global_batch_size: int = 1
    """Sequences per optimizer step over all data-parallel ranks."""
    seq_len: int = 4096
    recompute: str = "none"
    """One of :data:`RECOMPUTE_MODES`."""
    precision: str = "bf16"
    """Matmul precision: fp32 | bf16 | fp16 | fp8 (DeepSeek-V3's FP8 GEMMs inside bf16 training)."""
    moments_dtype: str = "fp32"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks one pp rank runs: 2 for the V and DualPipe's two directions."""
        if self.pp == 1:
            return 1
        if self.pp_schedule in ("DualPipe", "DualPipeV"):
            return 2
        return self.pp_virtual_stages if self.pp_schedule == "Interleaved1F1B" else 1

    @property
    def n_stages(self) -> int:
        """Distinct stages the layers are cut into (DualPipe's two directions share theirs)."""
        return self.pp if self.pp_schedule == "DualPipe" else self.pp * self.chunks_per_rank

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per step."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    def validate(self, model: ModelConfig, world_size: int | None = None) -> PlanLayout:
        """Structural checks only (the sizes must divide); runtime support is :meth:`runtime_issue`."""
        for name in ("dp", "tp", "pp", "ep", "pp_virtual_stages", "micro_batch_size", "global_batch_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"plan layout: {name}={value!r} must be a positive integer")
        if world_size is not None and self.world_size != world_size:
            raise ConfigError(
                f"parallel.dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} must equal the cluster's "
                f"{world_size} GPUs (cluster.nodes x cluster.gpus_per_node); set parallel.dp=null to fill it"
            )
        if self.pp_schedule not in SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule!r} is unknown to the planner; choose one of {SCHEDULES}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"plan.recompute={self.recompute!r} is unknown; choose one of {list(RECOMPUTE_MODES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"plan precision {self.precision!r} is unknown; choose one of {PRECISIONS}")
        if self.moments_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"optim.moments_dtype={self.moments_dtype!r} must be fp32 or bf16")
        if self.global_batch_size % (self.dp * self.micro_batch_size):
            raise ConfigError(
                f"data.global_batch_size={self.global_batch_size} must be a multiple of data.micro_batch_size="
                f"{self.micro_batch_size} x dp={self.dp}"
            )
        if model.n_heads % self.tp:
            raise ConfigError(f"parallel.tp={self.tp} does not divide model.n_heads={model.n_heads}")
        if self.n_stages > model.n_layers:
            raise ConfigError(f"{self.n_stages} pipeline stages exceed model.n_layers={model.n_layers}; lower parallel.pp")
        if self.ep > 1:
            if not model.is_moe or model.n_routed_experts % self.ep:
                raise ConfigError(f"parallel.ep={self.ep} must divide model.n_routed_experts={model.n_routed_experts}")
            if self.dp % self.ep:
                raise ConfigError(f"parallel.ep={self.ep} must divide dp={self.dp}: experts shard over dp ranks")
        if self.pp > 1 and self.micro_batches < self.pp:
            raise ConfigError(
                f"{self.micro_batches} micro-batches per step leave a pipeline of parallel.pp={self.pp} stages idle; "
                "raise data.global_batch_size or lower data.micro_batch_size"
            )
        return self

    def runtime_issue(self, model: ModelConfig) -> str | None:
        """Why dsl-lit's own runtime could not run this layout (None: it could)."""
        if self.pp_schedule in ("ZB1P", "DualPipe"):
            return f"parallel.pp_schedule={self.pp_schedule} is planned only; dsl-lit runs GPipe, 1F1B, Interleaved1F1B, DualPipeV"
        if self.recompute not in MODES:
            return f"plan.recompute={self.recompute} is planned only; dsl-lit's memory.recompute runs {list(MODES)}"
        if self.precision == "fp8" and self.tp > 1:
            return "FP8 linears do not take tensor-parallel weights yet"
        parallel = ParallelConfig(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, zero1=self.zero1,
                                  sequence_parallel=self.sequence_parallel, pp_schedule=self.pp_schedule,
                                  pp_virtual_stages=self.pp_virtual_stages if self.pp > 1 else 1)
        try:
            ParallelLayout.create(parallel, model, self.world_size)
        except ConfigError as error:
            return str(error)
        return None
