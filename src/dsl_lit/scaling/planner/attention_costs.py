"""What only the cluster planner asks of an attention kind: its norms, the elements it keeps for
backward, what DeepSeek-V3's recompute recipe keeps and recomputes, what FP8 casts.

One row per attention part (``config/model_parts/``), found along the part's class hierarchy (a
sparse latent attention is costed as MLA: the indexer's few activations are left out). A new
attention kind adds its part there and its row here.
"""

from __future__ import annotations

from typing import Protocol

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.attention import GroupedQueryShape, LatentAttentionShape
from dsl_lit.config.model_parts.v4_attention import V4AttentionShape, mean_over_layers


class AttentionCosts(Protocol):
    """The planner's questions about one attention kind, per token and per block."""

    @staticmethod
    def norm_params(cfg: ModelConfig) -> int:
        """Norm weights inside it."""

    @staticmethod
    def up_projection_params(cfg: ModelConfig) -> float:
        """Weights DeepSeek-V3's recompute recipe recomputes in backward."""

    @staticmethod
    def activation_elements(cfg: ModelConfig, mode: str, h: float, d: float, tp: int) -> float:
        """Elements per token kept for backward (``mode``: selective | none), block input included;
        ``h`` heads and ``d`` residual width on this rank."""

    @staticmethod
    def recipe_kept_elements(cfg: ModelConfig, h: float, tp: int) -> tuple[float, float]:
        """(kept, output) elements per token under DeepSeek-V3's recompute recipe."""

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        """(distinct linear inputs cast to FP8, linear outputs whose gradient is cast) per token."""


class GroupedQueryCosts:
    @staticmethod
    def norm_params(cfg: ModelConfig) -> int:
        """None: its input norm belongs to the block."""
        return 0

    @staticmethod
    def up_projection_params(cfg: ModelConfig) -> float:
        """None (MLA's up-projections are what the recipe recomputes)."""
        return 0.0

    @staticmethod
    def activation_elements(cfg: ModelConfig, mode: str, h: float, d: float, tp: int) -> float:
        hd, kv = cfg.head_dim, max(1.0, cfg.n_kv_heads / tp)
        if mode == "selective":  # x; q, k, v projections; attention output; wo output
            return 2 * d + h * hd + 2 * kv * hd + h * hd
        # x, norm output, q and k after rotary, v, attention output, wo's contiguous input
        return 2 * d + 3 * h * hd + 2 * kv * hd

    @staticmethod
    def recipe_kept_elements(cfg: ModelConfig, h: float, tp: int) -> tuple[float, float]:
        """q, k, v kept."""
        return (h + 2 * max(1.0, cfg.n_kv_heads / tp)) * cfg.head_dim, h * cfg.head_dim

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        return d + h * cfg.head_dim, (h + 2 * max(1.0, cfg.n_kv_heads / tp)) * cfg.head_dim + d


class LatentAttentionCosts:
    @staticmethod
    def norm_params(cfg: ModelConfig) -> int:
        """The kv latent's norm and the query latent's (when there is one)."""
        return cfg.kv_lora_rank + (cfg.q_lora_rank or 0)

    @staticmethod
    def up_projection_params(cfg: ModelConfig) -> float:
        """The up-projection weights (query and key/value) DeepSeek-V3's recipe recomputes."""
        kv = cfg.kv_lora_rank * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return kv + (cfg.q_lora_rank * cfg.n_heads * cfg.qk_head_dim if cfg.q_lora_rank else 0)

    @staticmethod
    def activation_elements(cfg: ModelConfig, mode: str, h: float, d: float, tp: int) -> float:
        qk, v, nope, rope = cfg.qk_head_dim, cfg.v_head_dim, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        latent = cfg.kv_lora_rank + rope
        if mode == "selective":  # x; wq_a, wq_b (or wq), wkv_a, wkv_b outputs; attention output; wo output
            queries = (cfg.q_lora_rank or 0) + h * qk
            return 2 * d + queries + latent + h * (nope + v) + h * v
        # x, norm output; query path (+ its norm); latent, its norm; wkv_b output; q and k concatenated,
        # v made contiguous, attention output, wo's contiguous input
        queries = 2 * cfg.q_lora_rank + h * qk if cfg.q_lora_rank else h * qk
        return 2 * d + queries + latent + cfg.kv_lora_rank + h * (nope + v) + 2 * h * qk + 3 * h * v

    @staticmethod
    def recipe_kept_elements(cfg: ModelConfig, h: float, tp: int) -> tuple[float, float]:
        """The latents the up-projections start from (and the queries when there is no query latent)."""
        latents = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        queries = 0.0 if cfg.q_lora_rank else h * cfg.qk_head_dim
        return latents + queries, h * cfg.v_head_dim

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        latent_kv = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        up_kv = h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        if cfg.q_lora_rank:
            inputs = d + cfg.q_lora_rank + cfg.kv_lora_rank + h * cfg.v_head_dim
            grads = cfg.q_lora_rank + h * cfg.qk_head_dim + latent_kv + up_kv + d
        else:
            inputs = d + cfg.kv_lora_rank + h * cfg.v_head_dim
            grads = h * cfg.qk_head_dim + latent_kv + up_kv + d
        return inputs, grads


class V4AttentionCosts:
    @staticmethod
    def norm_params(cfg: ModelConfig) -> int:
        """The query latent's and the key's norms, the compressors' (and the sinks, one per head),
        averaged over the layer schedule."""
        hd = cfg.attention_head_dim
        extra = {"sliding": 0, "csa": hd + cfg.index_head_dim, "hca": hd}
        return round((cfg.q_lora_rank or 0) + hd + cfg.n_heads + mean_over_layers(cfg, extra))

    @staticmethod
    def up_projection_params(cfg: ModelConfig) -> float:
        """The query up-projection DeepSeek-V3's recipe would recompute (V4 expands no key per head)."""
        return float((cfg.q_lora_rank or 0) * cfg.n_heads * cfg.attention_head_dim)

    @staticmethod
    def activation_elements(cfg: ModelConfig, mode: str, h: float, d: float, tp: int) -> float:
        """Block input, query latent and heads, the key, the attention output, the grouped
        projection's output (``none`` adds the norms' outputs and the rotated copies)."""
        hd, q = cfg.attention_head_dim, cfg.q_lora_rank or 0
        kept = 2 * d + q + h * hd + hd + h * hd + cfg.o_groups * cfg.o_lora_rank
        return kept if mode == "selective" else kept + q + 2 * h * hd + hd

    @staticmethod
    def recipe_kept_elements(cfg: ModelConfig, h: float, tp: int) -> tuple[float, float]:
        """The query latent and the key kept."""
        return (cfg.q_lora_rank or 0) + cfg.attention_head_dim, h * cfg.attention_head_dim

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        hd, q = cfg.attention_head_dim, cfg.q_lora_rank or 0
        inputs = d + q + h * hd + cfg.o_groups * cfg.o_lora_rank
        grads = q + h * hd + hd + cfg.o_groups * cfg.o_lora_rank + d
        return inputs, grads


ATTENTION_COSTS: dict[type, type[AttentionCosts]] = {
    GroupedQueryShape: GroupedQueryCosts,
    LatentAttentionShape: LatentAttentionCosts,
    V4AttentionShape: V4AttentionCosts,
}
"""Attention part -> its planner costs (looked up along the part's class hierarchy)."""


def attention_costs(cfg: ModelConfig) -> type[AttentionCosts]:
    """The planner costs of ``cfg``'s attention part."""
    for kind in cfg.attention.__mro__:
        if kind in ATTENTION_COSTS:
            return ATTENTION_COSTS[kind]
    raise TypeError(f"the cluster planner has no costs for {cfg.attention.__name__}: add its row to ATTENTION_COSTS")
