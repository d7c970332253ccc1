"""Tensor-parallel plan of Multi-head Latent Attention (DeepSeek-V3, and V2 which shares it); the
rest is the shared decoder's (:func:`dsl_lit.models.common.tp_plan.decoder_plan`).

The low-rank down-projections (wq_a, wkv_a) and their norms stay replicated, the up-projections
(wq_b or wq, wkv_b) are column-parallel and wo row-parallel. The rotary key that leaves ``wkv_a``
beside the latent is shared by every rank's own heads, so its gradient is summed over tp
(:data:`~dsl_lit.models.common.tp_plan.SHARED_ROPE_KEY`); the latent's is complete already, having
gone through the column-parallel ``wkv_b``. Under sequence parallelism the attention takes the full
sequence as a plain tensor: its replicated projections and the rotary key need every position,
identically on all ranks.
"""

from __future__ import annotations

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.tp_plan import (
    COLWISE,
    GATHER_ATTENTION_INPUT_LOCAL,
    ROWWISE,
    ROWWISE_TO_SEQUENCE,
    SHARED_ROPE_KEY,
    Plan,
    decoder_plan,
)


def attention_plan(cfg: ModelConfig, tp: int, sequence_parallel: bool) -> Plan:
    query_up = "wq_b" if cfg.q_lora_rank is not None else "wq"
    return {
        query_up: COLWISE,
        "wkv_b": COLWISE,
        "wo": ROWWISE_TO_SEQUENCE if sequence_parallel else ROWWISE,
        "wkv_a": SHARED_ROPE_KEY,
    }


def tp_plan(cfg: ModelConfig, tp: int, sequence_parallel: bool) -> Plan:
    return decoder_plan(cfg, tp, sequence_parallel, attention_plan, GATHER_ATTENTION_INPUT_LOCAL)
