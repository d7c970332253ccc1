"""What an attention kind answers about its shapes, as arithmetic on the config (no torch).

The rest of the code asks these questions instead of branching on which kind a family uses: the
config (:attr:`ModelConfig.kv_heads`, :attr:`ModelConfig.rope_dim`), FLOPs and pipeline stage costs
(``matmul_params``, ``score_flops``) and the cluster planner's memory and time. The attention modules
(``attention.py: GroupedQueryAttention``, ``mla.py: MultiHeadLatentAttention``) inherit their kind's
answers from the classes here, so a family's card names the shape without importing torch and
the module it builds answers the same; a new attention kind answers them too.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from dsl_lit.config.model import ModelConfig


class AttentionShape(Protocol):
    """The shape questions every attention kind answers, as static methods of its class."""

    latent: ClassVar[bool]
    """Whether keys and values are expanded from one compressed latent per token (MLA)."""

    @staticmethod
    def kv_heads(cfg: ModelConfig) -> int:
        """Key/value heads the attention computes (what tensor parallelism splits)."""

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        """Width of the rotary tables."""

    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """Weights of its projections."""

    @staticmethod
    def score_flops(cfg: ModelConfig, seq_len: int) -> float:
        """Forward FLOPs per token of its scores and values at ``seq_len`` keys, without causal halving
        (as PaLM and DeepSeek count)."""

    @staticmethod
    def norm_params(cfg: ModelConfig) -> int:
        """Norm weights inside it."""

    @staticmethod
    def up_projection_params(cfg: ModelConfig) -> float:
        """Weights DeepSeek-V3's recompute recipe recomputes in backward."""

    @staticmethod
    def activation_elements(cfg: ModelConfig, mode: str, h: float, d: float, tp: int) -> float:
        """Elements per token kept for backward (``mode``: selective | none)."""

    @staticmethod
    def recipe_kept_elements(cfg: ModelConfig, h: float, tp: int) -> tuple[float, float]:
        """(kept, output) elements per token under DeepSeek-V3's recompute recipe."""

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        """(linear inputs cast to FP8, linear outputs whose gradient is cast) per token."""


class GroupedQueryShape:
    """Grouped-query attention: ``n_kv_heads`` key/value heads of ``head_dim``, RoPE on the whole head."""

    latent: ClassVar[bool] = False
    """Keys and values are projected per kv head, not expanded from a shared latent (see MLA)."""

    @staticmethod
    def kv_heads(cfg: ModelConfig) -> int:
        """``n_kv_heads``."""
        return cfg.n_kv_heads

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        """The whole head."""
        return cfg.head_dim

    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """Weights of wq, wk, wv and wo: what FLOPs and pipeline stage costs count."""
        return cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)

    @staticmethod
    def score_flops(cfg: ModelConfig, seq_len: int) -> float:
        """Every query against ``seq_len`` keys: 2 n_heads (qk + v) seq_len."""
        return 2.0 * cfg.n_heads * 2 * cfg.head_dim * seq_len

    # -- shape questions the cluster planner asks ----------------------------------------------------
    @staticmethod
    def norm_params(cfg: ModelConfig) -> int:
        """Norm weights inside the attention (none: its input norm belongs to the block)."""
        return 0

    @staticmethod
    def up_projection_params(cfg: ModelConfig) -> float:
        """Weights DeepSeek-V3's recipe recomputes in backward (MLA's up-projections): none here."""
        return 0.0

    @staticmethod
    def activation_elements(cfg: ModelConfig, mode: str, h: float, d: float, tp: int) -> float:
        """Elements per token the attention keeps for backward under ``mode`` (selective | none),
        block input included; ``h`` heads and ``d`` residual width on this rank."""
        hd, kv = cfg.head_dim, max(1.0, cfg.n_kv_heads / tp)
        if mode == "selective":  # x; q, k, v projections; attention output; wo output
            return 2 * d + h * hd + 2 * kv * hd + h * hd
        # x, norm output, q and k after rotary, v, attention output, wo's contiguous input
        return 2 * d + 3 * h * hd + 2 * kv * hd

    @staticmethod
    def recipe_kept_elements(cfg: ModelConfig, h: float, tp: int) -> tuple[float, float]:
        """(kept, output) elements per token under DeepSeek-V3's recompute recipe: q, k, v kept."""
        return (h + 2 * max(1.0, cfg.n_kv_heads / tp)) * cfg.head_dim, h * cfg.head_dim

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        """(distinct linear inputs cast to FP8, linear outputs whose gradient is cast) per token."""
        return d + h * cfg.head_dim, (h + 2 * max(1.0, cfg.n_kv_heads / tp)) * cfg.head_dim + d


class LatentAttentionShape:
    """Multi-head Latent Attention: keys and values expanded per head from one latent per token,
    positions on a decoupled rotary key of ``qk_rope_head_dim`` shared by all heads."""

    latent: ClassVar[bool] = True
    """Keys and values are expanded from one compressed latent per token (what ``latent_attention``
    on the config reports: the rotary tables cover ``qk_rope_head_dim`` and every head has its own key)."""

    @staticmethod
    def kv_heads(cfg: ModelConfig) -> int:
        """One per query head: every head expands its own key and value from the latent."""
        return cfg.n_heads

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        """The decoupled rope part, ``qk_rope_head_dim``."""
        return cfg.qk_rope_head_dim


    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """Weights of the projections, low-rank paths included: what FLOPs and pipeline stage costs count."""
        h = cfg.n_heads
        if cfg.q_lora_rank is None:
            q = cfg.d_model * h * cfg.qk_head_dim
        else:
            q = cfg.d_model * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
        kv = cfg.d_model * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (
            cfg.qk_nope_head_dim + cfg.v_head_dim
        )
        return q + kv + h * cfg.v_head_dim * cfg.d_model

    @staticmethod
    def score_flops(cfg: ModelConfig, seq_len: int) -> float:
        """Every query against ``seq_len`` keys: 2 n_heads (qk + v) seq_len."""
        return 2.0 * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len

    # -- shape questions the cluster planner asks ----------------------------------------------------
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
        """Elements per token the attention keeps for backward under ``mode`` (selective | none),
        block input included; ``h`` heads and ``d`` residual width on this rank."""
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
        """(kept, output) elements per token under DeepSeek-V3's recompute recipe: the latents the
        up-projections start from (and the queries when there is no query latent)."""
        latents = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        queries = 0.0 if cfg.q_lora_rank else h * cfg.qk_head_dim
        return latents + queries, h * cfg.v_head_dim

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        """(distinct linear inputs cast to FP8, linear outputs whose gradient is cast) per token."""
        latent_kv = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        up_kv = h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        if cfg.q_lora_rank:
            inputs = d + cfg.q_lora_rank + cfg.kv_lora_rank + h * cfg.v_head_dim
            grads = cfg.q_lora_rank + h * cfg.qk_head_dim + latent_kv + up_kv + d
        else:
            inputs = d + cfg.kv_lora_rank + h * cfg.v_head_dim
            grads = h * cfg.qk_head_dim + latent_kv + up_kv + d
        return inputs, grads


class SparseLatentAttentionShape(LatentAttentionShape):
    """DeepSeek Sparse Attention (DeepSeek-V3.2): MLA whose queries attend to the ``index_topk`` keys a
    lightning indexer picks. Its cost is the indexer (projections, and its scores over every key)
    plus MLA over at most ``index_topk`` keys, not dense attention; memory and recompute as MLA's
    (the indexer's few activations are left out)."""

    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """MLA's projections plus the indexer's: ``wq_b`` from the query latent, ``wk``, ``weights_proj``."""
        indexer = (cfg.q_lora_rank or 0) * cfg.index_n_heads * cfg.index_head_dim + cfg.d_model * (
            cfg.index_head_dim + cfg.index_n_heads)
        return LatentAttentionShape.matmul_params(cfg) + indexer

    @staticmethod
    def score_flops(cfg: ModelConfig, seq_len: int) -> float:
        """The indexer's scores over ``seq_len`` keys (its heads' dot products and their weighting),
        and MLA over min(``index_topk``, ``seq_len``) keys."""
        indexer = 2.0 * cfg.index_n_heads * (cfg.index_head_dim + 1) * seq_len
        return indexer + LatentAttentionShape.score_flops(cfg, min(cfg.index_topk, seq_len))
