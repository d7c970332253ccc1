"""DeepSeek LLM's tensor-parallel plan: the grouped-query attention's part (the rest is the shared
decoder's, :func:`dsl_lit.models.common.tp_plan.decoder_plan`).

wq column-parallel, wo row-parallel; wk / wv column-parallel too when tp divides the kv heads.
When tp exceeds them (tp a multiple of ``n_kv_heads``), wk / wv stay whole (replicated, so
checkpoints and the optimizer see the full matrices) and each rank computes only the kv head its
query heads use. Under sequence parallelism the attention's input is a replicated DTensor, so the
three projections' input gradients add up before one reduce-scatter.
"""

from __future__ import annotations

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.tp_plan import (
    COLWISE,
    GATHER_ATTENTION_INPUT,
    KV_HEAD_PER_RANK,
    ROWWISE,
    ROWWISE_TO_SEQUENCE,
    Plan,
    decoder_plan,
)


def attention_plan(cfg: ModelConfig, tp: int, sequence_parallel: bool) -> Plan:
    kv = COLWISE if cfg.kv_heads % tp == 0 else KV_HEAD_PER_RANK
    return {"wq": COLWISE, "wk": kv, "wv": kv, "wo": ROWWISE_TO_SEQUENCE if sequence_parallel else ROWWISE}


def tp_plan(cfg: ModelConfig, tp: int, sequence_parallel: bool) -> Plan:
    return decoder_plan(cfg, tp, sequence_parallel, attention_plan, GATHER_ATTENTION_INPUT)
