"""DeepSeek-V4's card: its presets and field checks, without torch (``dsl_lit.models.families``);
what it builds is ``spec.py``."""

from __future__ import annotations

from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import (
    ATTENTION_KINDS,
    EXPERT_BACKENDS,
    INDEXER_FIELDS,
    MOE_FIELDS,
    SCORE_FUNCS,
    V4_FIELDS,
    ModelConfig,
)
from dsl_lit.models.deepseek_v4.attention_shape import V4AttentionShape
from dsl_lit.models.families import FamilyCard

PRESETS: dict[str, dict[str, Any]] = {
    # transformers 5.24's DeepseekV4Config defaults, documented there as DeepSeek-V4-Flash-Base: 43
    # layers of shared-KV attention (heads of 512, 64 of them rotated), 256 experts (6 active, one
    # shared), sqrt-softplus routing, 3 hash-routed layers, 4 mHC streams. The compressed layers'
    # YaRN (rope_scaling) is left unset, as in that default.
    "deepseek_v4_flash": dict(
        vocab_size=129280, n_layers=43, d_model=4096, n_heads=64, attention_head_dim=512, q_lora_rank=1024,
        qk_rope_head_dim=64, n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, moe_ffn_hidden=2048,
        score_func="sqrtsoftplus", route_scale=1.5, norm_topk_prob=True, max_seq_len=1048576, rope_theta=10000.0,
        compress_rope_theta=160000.0, csa_rate=4, hca_rate=128, sliding_window=128, o_groups=8, o_lora_rank=1024,
        index_n_heads=64, index_head_dim=128, index_topk=512, n_hash_layers=3, swiglu_limit=10.0, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, init_std=0.02, index_training="sparse",
    ),
    # CPU-sized, every mechanism on: each attention kind (a 16-token window, CSA every 4 tokens
    # keeping 4 windows, HCA every 16), a hash-routed layer, sqrt-softplus top-2 of 8 experts with the
    # clamped SwiGLU and a shared expert, 4 mHC streams.
    "deepseek_v4_tiny": dict(
        vocab_size=8192, n_layers=4, d_model=256, n_heads=8, attention_head_dim=64, q_lora_rank=128,
        qk_rope_head_dim=16, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_ffn_hidden=128,
        score_func="sqrtsoftplus", route_scale=1.5, norm_topk_prob=True, max_seq_len=1024,
        attention_kinds=["hca", "sliding", "csa", "hca"], csa_rate=4, hca_rate=16, sliding_window=16, o_groups=2,
        o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=4, n_hash_layers=1, swiglu_limit=10.0,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, index_training="sparse",
    ),
}

READS = ("q_lora_rank", "qk_rope_head_dim", *(f for f in MOE_FIELDS if f not in ("n_dense_layers", "n_expert_groups",
         "n_limited_groups")), *INDEXER_FIELDS, *V4_FIELDS)
"""What V4 reads of the optional fields: the query latent and the rotated width, the router and
experts (no dense layers, no expert groups), the CSA indexer, its own blocks."""
INDEX_TRAINING = ("off", "sparse")
"""How V4's CSA indexer trains: ``sparse`` by KL to the attention over the keys it selects (V3.2's
sparse stage; the presets), ``off`` not at all (a checkpoint read for inference)."""


def _positive_ints(cfg: ModelConfig, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{prefix}.{name}={value!r} must be a positive integer")


def validate(cfg: ModelConfig, prefix: str) -> None:
    _positive_ints(cfg, prefix, ("q_lora_rank", "attention_head_dim", "qk_rope_head_dim", "n_routed_experts",
                                 "n_activated_experts", "moe_ffn_hidden", "csa_rate", "hca_rate", "sliding_window",
                                 "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                                 "hc_sinkhorn_iters"))
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
    if cfg.n_activated_experts > cfg.n_routed_experts:
        raise ConfigError(f"{prefix}.n_activated_experts={cfg.n_activated_experts} exceeds "
                          f"n_routed_experts={cfg.n_routed_experts}")
    if not 0 <= cfg.n_hash_layers <= cfg.n_layers:
        raise ConfigError(f"{prefix}.n_hash_layers={cfg.n_hash_layers} must be between 0 and n_layers={cfg.n_layers}")
    if cfg.n_dense_layers:
        raise ConfigError(f"{prefix}.n_dense_layers={cfg.n_dense_layers}: every DeepSeek-V4 block is MoE; drop it")
    if cfg.score_func not in SCORE_FUNCS:
        raise ConfigError(f"{prefix}.score_func={cfg.score_func!r} is unknown; choose one of {SCORE_FUNCS}")
    if cfg.expert_backend not in EXPERT_BACKENDS:
        raise ConfigError(f"{prefix}.expert_backend={cfg.expert_backend!r} is unknown; choose one of {EXPERT_BACKENDS}")
    if cfg.swiglu_limit < 0 or cfg.hc_eps <= 0:
        raise ConfigError(f"{prefix}.swiglu_limit must be >= 0 (0: no clamp) and hc_eps > 0")
    if cfg.index_training not in INDEX_TRAINING:
        raise ConfigError(f"{prefix}.index_training={cfg.index_training!r}: DeepSeek-V4's CSA indexer trains "
                          f"with the model ({INDEX_TRAINING[1]}) or not at all ({INDEX_TRAINING[0]})")
    if cfg.compress_rope_theta <= 0:
        raise ConfigError(f"{prefix}.compress_rope_theta must be > 0")


CARD = FamilyCard(
    name="deepseek_v4",
    presets=PRESETS,
    base_preset="deepseek_v4_tiny",
    attention=V4AttentionShape,
    moe=True,
    mtp=False,  # the released checkpoints carry one MTP layer; transformers does not build it, nor do we yet
    validate=validate,
    spec_module="dsl_lit.models.deepseek_v4.spec",
    sparse_attention=False,  # its indexer is part of V4's own attention (the V4 fields), not V3.2's DSA
    unsupported_parallel={
        "sequence_parallel": "its hc_mult residual streams are not sharded over the sequence yet",
        "cp": "the compressed keys and the sliding window are not gathered over context-parallel ranks yet"},
    split_over_tp=("n_heads", "o_groups"),  # the grouped output projection splits by whole groups of heads
    packed_documents=False,  # its compressors window a row from its first real token, not per document
    reads=READS,
    ignores=("ffn_hidden",),
)
