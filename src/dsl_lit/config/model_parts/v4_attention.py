"""DeepSeek-V4's attention part: shared-KV attention with a sliding window and compressed keys
(DeepSeek-V4, sec. 2.3), its fields, their checks and its shape answers (no torch).

V4's layers differ by kind (sliding window, compressed sparse, heavily compressed), while the
shape questions are asked per block: the answers here are the mean over the layer schedule, so
that ``n_layers x`` an answer is the whole model's figure. A query's cost is its window plus the
compressed keys it reads (``index_topk`` of them in ``csa`` layers, after the indexer scored every
compressed key; all of them in ``hca`` layers), not dense attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from data_contract.errors import ConfigError
from dsl_lit.config.model_parts.attention import INDEXER_FIELDS
from dsl_lit.config.model_parts.part import require_ints

if TYPE_CHECKING:
    from dsl_lit.config.model import ModelConfig

ATTENTION_KINDS = ("sliding", "csa", "hca")
"""DeepSeek-V4's attention layer kinds: sliding window only, compressed sparse, heavily compressed."""
V4_ATTENTION_FIELDS = ("attention_head_dim", "attention_kinds", "csa_rate", "hca_rate", "compress_rope_theta",
                       "sliding_window", "o_groups", "o_lora_rank")
"""The fields of V4's attention of its own (besides the query latent, the rotated width and the CSA indexer)."""
INDEX_TRAINING = ("off", "sparse")
"""How V4's CSA indexer trains: ``sparse`` by KL to the attention over the keys it selects (V3.2's
sparse stage; the presets), ``off`` not at all (a checkpoint read for inference)."""


def mean_over_layers(cfg: ModelConfig, per_kind: dict[str, float]) -> float:
    """The mean of a per-kind figure over V4's layer schedule (what a per-block answer is)."""
    kinds = [cfg.attention_kind(i) for i in range(cfg.n_layers)]
    return sum(per_kind[k] for k in kinds) / len(kinds)


class V4AttentionShape:
    """Shared-KV attention with a sliding window and compressed keys (DeepSeek-V4, sec. 2.3)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("q_lora_rank", "qk_rope_head_dim", *INDEXER_FIELDS, *V4_ATTENTION_FIELDS)
    DESCRIPTION: ClassVar[str] = "DeepSeek-V4's compressed attention"
    latent: ClassVar[bool] = False
    """One key/value head projected from the token itself, not expanded from a latent per head."""

    @staticmethod
    def validate(cfg: ModelConfig, prefix: str) -> None:
        require_ints(cfg, prefix, ("q_lora_rank", "attention_head_dim", "qk_rope_head_dim", "csa_rate", "hca_rate",
                                   "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
                                   "index_topk"))
        if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > min(cfg.attention_head_dim, cfg.index_head_dim):
            raise ConfigError(f"{prefix}.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and at most "
                              f"attention_head_dim={cfg.attention_head_dim} and index_head_dim={cfg.index_head_dim} "
                              "(the rotated tail of each head)")
        if (cfg.n_heads * cfg.attention_head_dim) % cfg.o_groups:
            raise ConfigError(f"{prefix}.o_groups={cfg.o_groups} does not divide the {cfg.n_heads} heads x "
                              f"{cfg.attention_head_dim} channels of the grouped output projection")
        if cfg.n_heads % cfg.o_groups:
            raise ConfigError(f"{prefix}.o_groups={cfg.o_groups} does not divide n_heads={cfg.n_heads}")
        kinds = cfg.attention_kinds
        if kinds is not None:
            if not isinstance(kinds, (list, tuple)) or len(kinds) < cfg.n_layers:
                raise ConfigError(f"{prefix}.attention_kinds must list a kind for each of the {cfg.n_layers} layers "
                                  f"(the first n_layers are used), got {kinds!r}")
            bad = [k for k in kinds if k not in ATTENTION_KINDS]
            if bad:
                raise ConfigError(f"{prefix}.attention_kinds: {bad[0]!r} is unknown; choose among {ATTENTION_KINDS}")
        if cfg.index_training not in INDEX_TRAINING:
            raise ConfigError(f"{prefix}.index_training={cfg.index_training!r}: DeepSeek-V4's CSA indexer trains "
                              f"with the model ({INDEX_TRAINING[1]}) or not at all ({INDEX_TRAINING[0]})")
        if cfg.compress_rope_theta <= 0:
            raise ConfigError(f"{prefix}.compress_rope_theta must be > 0")

    @staticmethod
    def kv_heads(cfg: ModelConfig) -> int:
        """One shared key/value head."""
        return 1

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        """The rotated tail of each head, ``qk_rope_head_dim``."""
        return cfg.qk_rope_head_dim

    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """The projections (``wq_a``, ``wq_b``, ``wkv``, the grouped ``wo_a`` and ``wo_b``), plus the
        compressors' (``wkv``, ``wgate``: two widths in ``csa``, one in ``hca``) and the ``csa``
        indexer's (its compressor, ``wq_b``, ``weights_proj``), averaged over the layers."""
        d, h, hd, ihd, q = cfg.d_model, cfg.n_heads, cfg.attention_head_dim, cfg.index_head_dim, cfg.q_lora_rank or 0
        common = d * q + q * h * hd + d * hd + h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
        indexer = 2 * d * 2 * ihd + q * cfg.index_n_heads * ihd + d * cfg.index_n_heads
        extra = {"sliding": 0, "csa": 2 * d * 2 * hd + indexer, "hca": 2 * d * hd}
        return round(common + mean_over_layers(cfg, extra))

    @staticmethod
    def score_flops(cfg: ModelConfig, seq_len: int) -> float:
        """Per query: scores and values (one head width each) over its window and the compressed
        keys it reads, and in ``csa`` layers the indexer's scores over every compressed key."""
        h, hd, window = cfg.n_heads, cfg.attention_head_dim, min(cfg.sliding_window, seq_len)
        csa_keys, hca_keys = seq_len / cfg.csa_rate, seq_len / cfg.hca_rate
        indexer = 2.0 * cfg.index_n_heads * (cfg.index_head_dim + 1) * csa_keys
        keys = {"sliding": window, "csa": window + min(cfg.index_topk, csa_keys), "hca": window + hca_keys}
        attention = {kind: 2.0 * h * 2 * hd * n for kind, n in keys.items()}
        attention["csa"] += indexer
        return mean_over_layers(cfg, attention)

