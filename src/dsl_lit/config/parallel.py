"""The ``parallel`` group and the one object that owns a run's layout.

``ParallelConfig`` is what the user writes (``parallel.tp=2``); :class:`ParallelLayout` is the
validated layout of a world size: the degrees with ``dp`` derived once, the mesh's shape and
dimension names, and every check, each message naming the field and the fix
(``parallel.tp=3 does not divide model.n_heads=16``). The Strategy, the data module, the planner
and the tests all read degrees from a ``ParallelLayout``, never recompute them.
"""

from __future__ import annotations

from dataclasses import dataclass

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.pipeline_schedules import RUNNABLE as PP_SCHEDULES
from dsl_lit.config.pipeline_schedules import schedule


@dataclass
class ParallelConfig:
    """``parallel`` group: the device-mesh layout. ``dp`` defaults to what tp, pp and cp leave of
    the world size (``trainer.devices x trainer.num_nodes``); ``ep`` shards experts over dp ranks;
    ``cp`` shards every sequence over that many ranks (context parallelism)."""

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1
    zero1: bool = False

    def validate(self) -> ParallelConfig:
        for name in ("tp", "pp", "ep", "cp", "pp_virtual_stages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.dp is not None and self.dp < 1:
            raise ConfigError(f"parallel.dp={self.dp} must be >= 1 (or null for what tp and pp leave)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule!r} is unknown; choose one of {PP_SCHEDULES}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it shards the sequence over tp)")
        return self


MESH_DIM_NAMES = ("pp", "edp", "ep", "cp", "tp")
"""The device mesh's dimensions, outermost first: pipeline stages, then expert-data-parallel
replicas, expert-parallel ranks, context-parallel ranks and tensor-parallel ranks (adjacent: one
node). ``dp`` is the flattened (edp, ep); cp ranks hold the same weights and different positions
of the same rows, so gradients average over (edp, ep, cp)."""


@dataclass(frozen=True)
class ParallelLayout:
    """A validated layout of ``world_size`` processes: pp x dp x cp x tp with dp = edp x ep."""

    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    zero1: bool = False
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1

    @classmethod
    def create(cls, parallel: ParallelConfig, model: ModelConfig, world_size: int) -> ParallelLayout:
        """Validate ``parallel`` for ``model`` on ``world_size`` processes (ConfigError otherwise)."""
        parallel.validate()
        dp = validate_layout(parallel, model, world_size)
        return cls(world_size=world_size, dp=dp, tp=parallel.tp, pp=parallel.pp, ep=parallel.ep, cp=parallel.cp,
                   sequence_parallel=parallel.sequence_parallel, zero1=parallel.zero1,
                   pp_schedule=parallel.pp_schedule, pp_virtual_stages=parallel.pp_virtual_stages)

    @staticmethod
    def derive_dp(world_size: int, tp: int = 1, pp: int = 1, world: str = "", cp: int = 1) -> int:
        """Data-parallel replicas: what tp, pp and cp leave of the world (the one place it is
        computed). ``world`` names where the processes come from in the error message."""
        if world_size % (tp * pp * cp):
            world = world or f"the world size trainer.devices x trainer.num_nodes = {world_size}"
            degrees = f"parallel.tp={tp} x parallel.pp={pp}" + (f" x parallel.cp={cp}" if cp > 1 else "")
            raise ConfigError(f"{degrees} = {tp * pp * cp} does not divide {world}")
        return world_size // (tp * pp * cp)

    @property
    def edp(self) -> int:
        """Replicas that hold the same routed experts."""
        return self.dp // self.ep

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int]:
        """Sizes of :data:`MESH_DIM_NAMES`."""
        return (self.pp, self.edp, self.ep, self.cp, self.tp)

    @property
    def replicas(self) -> int:
        """Ranks whose gradients are averaged: data-parallel replicas times context-parallel ranks."""
        return self.dp * self.cp

    @property
    def shards_model(self) -> bool:
        """Whether a rank holds less than the whole model (tensor, pipeline or expert parallel)."""
        return self.tp > 1 or self.pp > 1 or self.ep > 1

    def micro_batches_per_step(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return global_batch_size // (self.dp * micro_batch_size)

    def check_micro_batches(self, global_batch_size: int, micro_batch_size: int) -> None:
        """What the pipeline schedule needs of the micro-batches per rank and step (ConfigError)."""
        validate_pipeline_micro_batches(self, self.micro_batches_per_step(global_batch_size, micro_batch_size))


def check_expert_parallel(cfg: ModelConfig, ep: int) -> None:
    """Raise ConfigError (naming the fields and the fix) for an ep size this model cannot use."""
    if not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"parallel.ep={ep!r} must be a positive integer")
    if ep == 1:
        return
    if not cfg.is_moe:
        raise ConfigError(f"parallel.ep={ep} needs a model with routed experts (model {cfg.name!r} has none)")
    if cfg.n_routed_experts % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide model.n_routed_experts={cfg.n_routed_experts}; "
            "every ep rank must hold the same number of experts"
        )
    if cfg.expert_backend == "loop":
        raise ConfigError(
            f"model.expert_backend=loop is a single-device reference and cannot run with parallel.ep={ep}; "
            "use expert_backend=grouped_mm or split"
        )
    groups, limited = cfg.n_expert_groups, cfg.n_limited_groups
    if limited < groups and groups % ep and ep % groups:
        raise ConfigError(
            f"model.n_expert_groups={groups} and parallel.ep={ep}: with model.n_limited_groups={limited} < "
            "n_expert_groups, node-limited routing bounds the ranks a token is sent to only if the expert "
            f"groups line up with ep ranks; make one divide the other (e.g. model.n_expert_groups={ep})"
        )


def check_context_parallel(parallel: ParallelConfig) -> None:
    """The products with context parallelism that are not built (ConfigError naming the fix)."""
    cp = parallel.cp
    if parallel.sequence_parallel:
        raise ConfigError(
            f"parallel.cp={cp} with parallel.sequence_parallel=true is not implemented yet: both would shard the "
            "sequence dimension; use one of them"
        )


def check_context_parallel_seq_len(cp: int, seq_len: int) -> None:
    """Load-balanced chunking cuts every sequence into 2 x cp equal chunks (ConfigError otherwise)."""
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"data.seq_len={seq_len} must be a multiple of 2 x parallel.cp = {2 * cp}: each context-parallel rank "
            f"holds two of 2 x cp equal chunks of every sequence; pick data.seq_len={seq_len - seq_len % (2 * cp)} "
            "or another parallel.cp"
        )


def check_world_size(dp: int, tp: int, pp: int, cp: int, world_size: int,
                     world: str = "the world size trainer.devices x trainer.num_nodes",
                     fix: str = "leave parallel.dp=null to use what tp, pp and cp leave") -> None:
    """The degrees multiply to the world size (``world`` names where the processes come from)."""
    if dp * tp * pp * cp != world_size:
        raise ConfigError(
            f"parallel.dp={dp} x tp={tp} x pp={pp}{f' x cp={cp}' if cp > 1 else ''} must equal {world} = "
            f"{world_size}; {fix}"
        )


def check_heads(model: ModelConfig, tp: int) -> None:
    """Tensor parallelism splits the attention heads (and what else the family's card lists)."""
    for field in model.split_over_tp:
        if getattr(model, field) % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide model.{field}={getattr(model, field)}; pick a divisor")


def check_ep_over_dp(ep: int, dp: int) -> None:
    """Experts shard over data-parallel ranks."""
    if dp % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the data-parallel size {dp}: experts shard over dp ranks")


def validate_layout(parallel: ParallelConfig, model: ModelConfig, world_size: int) -> int:
    """Check the layout; return the data-parallel size."""
    tp, pp, ep, cp = parallel.tp, parallel.pp, parallel.ep, parallel.cp
    dp = parallel.dp or ParallelLayout.derive_dp(world_size, tp, pp, cp=cp)
    check_world_size(dp, tp, pp, cp, world_size)
    if cp > 1:
        check_context_parallel(parallel)
    if tp > 1:
        check_heads(model, tp)
        if model.kv_heads % tp and tp % model.kv_heads:
            raise ConfigError(
                f"parallel.tp={tp} and model.n_kv_heads={model.n_kv_heads}: one must divide the other "
                "(kv heads are sharded, or replicated across tp ranks)"
            )
        if model.vocab_size % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide model.vocab_size={model.vocab_size} (vocab-parallel head)")
    virtual, row = parallel.pp_virtual_stages, schedule(parallel.pp_schedule)
    fixed = row.stages_per_rank
    if fixed is not None and fixed > 1:
        if virtual not in (1, fixed):
            shape = " (a V)" if row.placement == "v" else ""
            raise ConfigError(
                f"parallel.pp_schedule={row.name} runs exactly {fixed} stages per rank{shape}; "
                f"parallel.pp_virtual_stages={virtual} must be {fixed} (or 1, read as {fixed})"
            )
        virtual = fixed
    elif fixed == 1 and virtual != 1:
        several = next(name for name in PP_SCHEDULES if schedule(name).stages_per_rank is None)
        raise ConfigError(
            f"parallel.pp_schedule={row.name} runs one stage per rank; set parallel.pp_virtual_stages=1 "
            f"or use parallel.pp_schedule={several}"
        )
    stages = pp * virtual
    if pp > 1 and stages > model.n_layers:
        raise ConfigError(
            f"parallel.pp={pp} x parallel.pp_virtual_stages={parallel.pp_virtual_stages} = {stages} stages "
            f"exceed model.n_layers={model.n_layers}; each stage needs at least one layer"
        )
    if fixed is None and pp > 1 and virtual < 2:
        raise ConfigError(
            f"parallel.pp_schedule={row.name} runs several stages per rank; set parallel.pp_virtual_stages=2 (or more)"
        )
    if pp > 1 and model.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings=true with parallel.pp={pp}: the embedding (first stage) and the head (last stage) "
            "would be one tensor on two ranks; untie them or use parallel.pp=1"
        )
    if ep > 1:
        check_expert_parallel(model, ep)
        check_ep_over_dp(ep, dp)
        if parallel.zero1:
            raise ConfigError(
                f"parallel.zero1=true with parallel.ep={ep} is not implemented yet: ZeRO-1's reduce-scatter over dp "
                "would mix different ranks' experts; use one of them"
            )
    if parallel.sequence_parallel and pp > 1:
        raise ConfigError(
            f"parallel.sequence_parallel=true with parallel.pp={pp} is not implemented yet: stage boundaries would "
            "carry sequence shards; use sequence parallelism without pipeline stages, or parallel.sequence_parallel=false"
        )
    return dp


def validate_pipeline_micro_batches(parallel: ParallelConfig | ParallelLayout, n_micro_batches: int) -> None:
    """What each schedule needs of the micro-batches per rank and step
    (``data.global_batch_size / (dp x data.micro_batch_size)``)."""
    pp, row = parallel.pp, schedule(parallel.pp_schedule)
    if pp == 1:
        return
    fix = "raise data.global_batch_size or lower data.micro_batch_size"
    factor = row.min_micro_batches_per_pp_rank
    if n_micro_batches < factor * pp:
        least = f"parallel.pp={pp}" if factor == 1 else f"{factor} x parallel.pp={factor * pp}"
        raise ConfigError(f"parallel.pp_schedule={row.name} needs at least {least} micro-batches per step, got "
                          f"{n_micro_batches}; {fix}")
    if row.micro_batches_multiple_of_pp:
        rounds = max(1, n_micro_batches // pp)
        if n_micro_batches % rounds:
            raise ConfigError(f"parallel.pp_schedule={row.name} needs the {n_micro_batches} micro-batches per step "
                              f"to be a multiple of parallel.pp={pp} (or fewer than it); {fix}")
