"""The attention parts: grouped-query, Multi-head Latent Attention, and MLA with DeepSeek Sparse
Attention's lightning indexer, each answering its shape questions as arithmetic on the config.

The rest of the code asks these questions instead of branching on which kind a family uses: the
config (:attr:`ModelConfig.kv_heads`, :attr:`ModelConfig.rope_dim`), FLOPs and pipeline stage costs
(``matmul_params``, ``score_flops``). The attention modules (``models/common/attention.py``,
``mla.py``, ``dsa.py``) inherit their kind's answers from the classes here, so a family names its
attention without importing torch and the module it builds answers the same. What only the
cluster planner asks (memory kept for backward, FP8 casts, recompute) is the planner's own
(``scaling/planner/attention_costs.py``). The classes are plain (no dataclass): modules inherit
them, and a module compares and hashes by identity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

from data_contract.errors import ConfigError
from dsl_lit.config.model_parts.part import require_ints

if TYPE_CHECKING:
    from dsl_lit.config.model import ModelConfig

LATENT_ATTENTION_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                           "rope_interleave")
"""Fields only Multi-head Latent Attention reads."""
INDEXER_FIELDS = ("index_n_heads", "index_head_dim", "index_topk", "index_training")
"""The lightning indexer's fields (DeepSeek Sparse Attention; DeepSeek-V4's compressed sparse layers)."""
INDEX_TRAINING = ("off", "warmup", "sparse")
"""How DeepSeek-V3.2's indexer trains (``ModelConfig.index_training``)."""


class AttentionShape(Protocol):
    """The questions every attention kind answers, as static methods of its class."""

    FIELDS: ClassVar[tuple[str, ...]]
    DESCRIPTION: ClassVar[str]
    latent: ClassVar[bool]
    """Whether keys and values are expanded from one compressed latent per token (MLA)."""

    @staticmethod
    def validate(cfg: ModelConfig, prefix: str) -> None:
        """ConfigError naming ``<prefix>.<field>`` for a value of its fields it cannot be built with."""

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


class GroupedQueryShape:
    """Grouped-query attention: ``n_kv_heads`` key/value heads of ``head_dim``, RoPE on the whole head."""

    FIELDS: ClassVar[tuple[str, ...]] = ("n_kv_heads",)
    DESCRIPTION: ClassVar[str] = "grouped-query attention"
    latent: ClassVar[bool] = False
    """Keys and values are projected per kv head, not expanded from a shared latent (see MLA)."""

    @staticmethod
    def validate(cfg: ModelConfig, prefix: str) -> None:
        """The heads tile ``d_model``, the kv heads tile the heads, the head is even (rotary pairs)."""
        if cfg.d_model % cfg.n_heads:
            raise ConfigError(
                f"{prefix}.n_heads={cfg.n_heads} does not divide {prefix}.d_model={cfg.d_model}; "
                "pick n_heads so that d_model / n_heads is an integer head dimension"
            )
        if cfg.n_heads % cfg.n_kv_heads:
            raise ConfigError(
                f"{prefix}.n_kv_heads={cfg.n_kv_heads} does not divide {prefix}.n_heads={cfg.n_heads}; "
                "grouped-query attention needs n_heads to be a multiple of n_kv_heads"
            )
        if cfg.head_dim % 2:
            raise ConfigError(f"{prefix}: head_dim={cfg.head_dim} must be even for rotary embeddings")

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


class LatentAttentionShape:
    """Multi-head Latent Attention: keys and values expanded per head from one latent per token,
    positions on a decoupled rotary key of ``qk_rope_head_dim`` shared by all heads."""

    FIELDS: ClassVar[tuple[str, ...]] = LATENT_ATTENTION_FIELDS
    DESCRIPTION: ClassVar[str] = "latent attention (MLA)"
    latent: ClassVar[bool] = True
    """Keys and values are expanded from one compressed latent per token (the rotary tables cover
    ``qk_rope_head_dim`` and every head has its own key)."""

    @staticmethod
    def validate(cfg: ModelConfig, prefix: str) -> None:
        """The latent and head widths are positive (the query latent when there is one), the rotary part even."""
        require_ints(cfg, prefix, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                     + (("q_lora_rank",) if cfg.q_lora_rank is not None else ()))
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"{prefix}.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for rotary embeddings")

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


class SparseLatentAttentionShape(LatentAttentionShape):
    """DeepSeek Sparse Attention (DeepSeek-V3.2): MLA whose queries attend to the ``index_topk`` keys a
    lightning indexer picks. Its cost is the indexer (projections, and its scores over every key)
    plus MLA over at most ``index_topk`` keys, not dense attention."""

    FIELDS: ClassVar[tuple[str, ...]] = LATENT_ATTENTION_FIELDS + INDEXER_FIELDS
    DESCRIPTION: ClassVar[str] = "a lightning indexer (DeepSeek Sparse Attention)"

    @staticmethod
    def validate(cfg: ModelConfig, prefix: str) -> None:
        """MLA's checks, plus the indexer's: it reads MLA's query latent and rotates its first
        ``qk_rope_head_dim`` dims."""
        LatentAttentionShape.validate(cfg, prefix)
        if cfg.q_lora_rank is None:
            raise ConfigError(f"{prefix}.q_lora_rank=null: DeepSeek Sparse Attention's indexer reads the query "
                              "latent; set a q_lora_rank")
        require_ints(cfg, prefix, ("index_n_heads", "index_head_dim", "index_topk"))
        if cfg.index_training not in INDEX_TRAINING:
            raise ConfigError(f"{prefix}.index_training={cfg.index_training!r} is unknown; choose one of {INDEX_TRAINING}")
        if cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise ConfigError(f"{prefix}.index_head_dim={cfg.index_head_dim} is below qk_rope_head_dim="
                              f"{cfg.qk_rope_head_dim}: the indexer rotates its first qk_rope_head_dim dims")

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
