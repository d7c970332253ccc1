"""Start-up validation of a parallel layout against the model, before any process group exists.

Every message names the field and the fix (``parallel.tp=3 does not divide model.n_heads=16``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsl_lit.errors import ConfigError
from dsl_lit.models.config import ModelConfig
from dsl_lit.parallel.expert_parallel import check_expert_parallel

if TYPE_CHECKING:
    from dsl_lit.config import ParallelConfig

IMPLEMENTED = ("dp", "zero1", "tp", "sequence_parallel", "pp", "ep")
"""What the strategy applies: every ``parallel`` field (some combinations are rejected below)."""


def validate_layout(parallel: ParallelConfig, model: ModelConfig, world_size: int) -> int:
    """Check the layout; return the data-parallel size."""
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    if world_size % (tp * pp):
        raise ConfigError(
            f"parallel.tp={tp} x parallel.pp={pp} = {tp * pp} does not divide the world size "
            f"trainer.devices x trainer.num_nodes = {world_size}"
        )
    dp = parallel.dp or world_size // (tp * pp)
    if dp * tp * pp != world_size:
        raise ConfigError(
            f"parallel.dp={dp} x tp={tp} x pp={pp} must equal the world size trainer.devices x "
            f"trainer.num_nodes = {world_size}; leave parallel.dp=null to use what tp and pp leave"
        )
    if tp > 1:
        if model.n_heads % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide model.n_heads={model.n_heads}; pick a divisor")
        if model.family == "deepseek_llm" and model.n_kv_heads % tp and tp % model.n_kv_heads:
            raise ConfigError(
                f"parallel.tp={tp} and model.n_kv_heads={model.n_kv_heads}: one must divide the other "
                "(kv heads are sharded, or replicated across tp ranks)"
            )
        if model.vocab_size % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide model.vocab_size={model.vocab_size} (vocab-parallel head)")
    virtual = parallel.pp_virtual_stages
    if parallel.pp_schedule == "DualPipeV":
        if virtual not in (1, 2):
            raise ConfigError(
                f"parallel.pp_schedule=DualPipeV runs exactly 2 stages per rank (a V); "
                f"parallel.pp_virtual_stages={virtual} must be 2 (or 1, read as 2)"
            )
        virtual = 2
    elif parallel.pp_schedule in ("1F1B", "GPipe") and virtual != 1:
        raise ConfigError(
            f"parallel.pp_schedule={parallel.pp_schedule} runs one stage per rank; set parallel.pp_virtual_stages=1 "
            "or use parallel.pp_schedule=Interleaved1F1B"
        )
    stages = pp * virtual
    if pp > 1 and stages > model.n_layers:
        raise ConfigError(
            f"parallel.pp={pp} x parallel.pp_virtual_stages={parallel.pp_virtual_stages} = {stages} stages "
            f"exceed model.n_layers={model.n_layers}; each stage needs at least one layer"
        )
    if parallel.pp_schedule == "Interleaved1F1B" and pp > 1 and virtual < 2:
        raise ConfigError(
            "parallel.pp_schedule=Interleaved1F1B runs several stages per rank; set parallel.pp_virtual_stages=2 (or more)"
        )
    if pp > 1 and model.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings=true with parallel.pp={pp}: the embedding (first stage) and the head (last stage) "
            "would be one tensor on two ranks; untie them or use parallel.pp=1"
        )
    if ep > 1:
        check_expert_parallel(model, ep)
        if dp % ep:
            raise ConfigError(f"parallel.ep={ep} does not divide the data-parallel size {dp}: experts shard over dp ranks")
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


def validate_pipeline_micro_batches(parallel: ParallelConfig, n_micro_batches: int) -> None:
    """What each schedule needs of the micro-batches per rank and step
    (``data.global_batch_size / (dp x data.micro_batch_size)``)."""
    pp, schedule = parallel.pp, parallel.pp_schedule
    if pp == 1:
        return
    fix = "raise data.global_batch_size or lower data.micro_batch_size"
    if schedule == "1F1B" and n_micro_batches < pp:
        raise ConfigError(f"parallel.pp_schedule=1F1B needs at least parallel.pp={pp} micro-batches per step, got "
                          f"{n_micro_batches}; {fix}")
    if schedule == "DualPipeV" and n_micro_batches < 2 * pp:
        raise ConfigError(f"parallel.pp_schedule=DualPipeV needs at least 2 x parallel.pp={2 * pp} micro-batches "
                          f"per step, got {n_micro_batches}; {fix}")
    if schedule == "Interleaved1F1B":
        rounds = max(1, n_micro_batches // pp)
        if n_micro_batches % rounds:
            raise ConfigError(f"parallel.pp_schedule=Interleaved1F1B needs the {n_micro_batches} micro-batches per step "
                              f"to be a multiple of parallel.pp={pp} (or fewer than it); {fix}")
