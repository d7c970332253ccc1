"""DeepSeek-V4's attention shapes, as arithmetic on the config (no torch): what FLOPs, pipeline
stage costs and the cluster planner ask of an attention kind (``models/common/attention_shape.py``).

V4's layers differ by kind (sliding window, compressed sparse, heavily compressed), while the
shape questions are asked per block: the answers here are the mean over the layer schedule, so
that ``n_layers x`` an answer is the whole model's figure. A query's cost is its window plus the
compressed keys it reads (``index_topk`` of them in ``csa`` layers, after the indexer scored every
compressed key; all of them in ``hca`` layers), not dense attention.
"""

from __future__ import annotations

from typing import ClassVar

from dsl_lit.config.model import ModelConfig


def _kinds(cfg: ModelConfig) -> list[str]:
    return [cfg.attention_kind(i) for i in range(cfg.n_layers)]


def _mean(cfg: ModelConfig, per_kind: dict[str, float]) -> float:
    kinds = _kinds(cfg)
    return sum(per_kind[k] for k in kinds) / len(kinds)


class V4AttentionShape:
    """Shared-KV attention with a sliding window and compressed keys (DeepSeek-V4, sec. 2.3)."""

    latent: ClassVar[bool] = False
    """One key/value head projected from the token itself, not expanded from a latent per head."""

    @staticmethod
    def kv_heads(cfg: ModelConfig) -> int:
        """One shared key/value head."""
        return 1

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        """The rotated tail of each head, ``qk_rope_head_dim``."""
        return cfg.qk_rope_head_dim

    @staticmethod
    def _common_params(cfg: ModelConfig) -> int:
        d, h, hd, q = cfg.d_model, cfg.n_heads, cfg.attention_head_dim, cfg.q_lora_rank or 0
        return d * q + q * h * hd + d * hd + h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d

    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """The projections (``wq_a``, ``wq_b``, ``wkv``, the grouped ``wo_a`` and ``wo_b``), plus the
        compressors' (``wkv``, ``wgate``: two widths in ``csa``, one in ``hca``) and the ``csa``
        indexer's (its compressor, ``wq_b``, ``weights_proj``), averaged over the layers."""
        d, hd, ihd = cfg.d_model, cfg.attention_head_dim, cfg.index_head_dim
        indexer = 2 * d * 2 * ihd + (cfg.q_lora_rank or 0) * cfg.index_n_heads * ihd + d * cfg.index_n_heads
        extra = {"sliding": 0, "csa": 2 * d * 2 * hd + indexer, "hca": 2 * d * hd}
        return round(V4AttentionShape._common_params(cfg) + _mean(cfg, extra))

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
        return _mean(cfg, attention)

    @staticmethod
    def norm_params(cfg: ModelConfig) -> int:
        """The query latent's and the key's norms, the compressors' (and the sinks, one per head)."""
        hd = cfg.attention_head_dim
        extra = {"sliding": 0, "csa": hd + cfg.index_head_dim, "hca": hd}
        return round((cfg.q_lora_rank or 0) + hd + cfg.n_heads + _mean(cfg, extra))

    @staticmethod
    def up_projection_params(cfg: ModelConfig) -> float:
        """The query up-projection DeepSeek-V3's recipe would recompute (V4 expands no key per head)."""
        return float((cfg.q_lora_rank or 0) * cfg.n_heads * cfg.attention_head_dim)

    @staticmethod
    def activation_elements(cfg: ModelConfig, mode: str, h: float, d: float, tp: int) -> float:
        """Elements per token kept for backward: block input, query latent and heads, the key, the
        attention output, the grouped projection's output (``none`` adds the norms' outputs and the
        rotated copies)."""
        hd, q = cfg.attention_head_dim, cfg.q_lora_rank or 0
        kept = 2 * d + q + h * hd + hd + h * hd + cfg.o_groups * cfg.o_lora_rank
        return kept if mode == "selective" else kept + q + 2 * h * hd + hd

    @staticmethod
    def recipe_kept_elements(cfg: ModelConfig, h: float, tp: int) -> tuple[float, float]:
        """(kept, output) per token under DeepSeek-V3's recompute recipe: the query latent and the key kept."""
        return (cfg.q_lora_rank or 0) + cfg.attention_head_dim, h * cfg.attention_head_dim

    @staticmethod
    def fp8_cast_elements(cfg: ModelConfig, h: float, d: float, tp: int) -> tuple[float, float]:
        """(linear inputs cast to FP8, linear outputs whose gradient is cast) per token."""
        hd, q = cfg.attention_head_dim, cfg.q_lora_rank or 0
        inputs = d + q + h * hd + cfg.o_groups * cfg.o_lora_rank
        grads = q + h * hd + hd + cfg.o_groups * cfg.o_lora_rank + d
        return inputs, grads
