"""Tensor-parallel plan of DeepSeek-V4's attention; the rest is the shared decoder's
(:func:`dsl_lit.models.common.tp_plan.decoder_plan`: vocab-parallel embedding and head, MoE with
replicated router and routed experts and column/row-parallel shared experts).

Each rank computes its own query heads and whole groups of the grouped output projection: ``wq_b``
is column-parallel (``wq_a`` and the query norm stay replicated), ``wo_a`` holds the rank's groups
(read directly by the model, so it only needs its rows) and ``wo_b`` is row-parallel, all-reducing
the output. The one key/value head (``wkv`` and its norm) and the compressors' pooled keys are
replicated and read by every rank's own heads, so their output gradients are summed over tp
(:data:`~dsl_lit.models.common.tp_plan.SHARED_BY_HEADS`, on the norms, so the norms' weights get
the whole gradient too); the per-head sinks split like the heads. The CSA indexer is replicated: it
reads detached inputs, every rank selects the same keys, and its KL target sums the ranks' heads.
mHC's stream mixing is replicated. Sequence parallelism is refused at start-up (the card): the
residual is ``hc_mult`` streams, not one sequence to shard. The MTP blocks (``mtp.<k>.block``) split as
the layers do; their input projections (``e_proj``, ``h_proj``) and stream collapse stay replicated.
"""

from __future__ import annotations

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.tp_plan import COLWISE, HEAD_SHARDED, ROWWISE, SHARED_BY_HEADS, Plan, decoder_plan


def attention_plan(cfg: ModelConfig, tp: int, sequence_parallel: bool) -> Plan:
    """Every layer kind's names (:func:`tp_plan` drops ``compressor`` where a layer has none)."""
    return {
        "wq_b": COLWISE,
        "kv_norm": SHARED_BY_HEADS,
        "compressor.norm": SHARED_BY_HEADS,
        "attn_sink": HEAD_SHARDED,
        "wo_a": COLWISE,
        "wo_b": ROWWISE,
    }


def tp_plan(cfg: ModelConfig, tp: int, sequence_parallel: bool) -> Plan:
    if sequence_parallel:  # (refused at start-up by the card)
        raise ValueError("DeepSeek-V4's tensor-parallel plan has no sequence parallelism")
    plan = decoder_plan(cfg, tp, sequence_parallel, attention_plan, attention_input="")
    blocks = [(f"layers.{i}", i) for i in range(cfg.n_layers)]
    blocks += [(f"mtp.{k}.block", cfg.n_layers + k) for k in range(cfg.mtp_modules)]  # the MTP blocks: sliding
    sliding = {f"{prefix}.attention.compressor.norm" for prefix, i in blocks if cfg.attention_kind(i) == "sliding"}
    return {name: style for name, style in plan.items() if name not in sliding}
