"""DeepSeek-V4 (transformers 5.24's ``DeepseekV4Config``): shared-KV attention with a sliding window
and compressed keys (CSA / HCA), hash-routed and top-k experts with ``sqrtsoftplus`` scores, a
grouped output projection, manifold-constrained hyper-connections, multi-token prediction (the
release's ``MTPBlock``: ``models/deepseek_v4/model.py``)."""

from __future__ import annotations

from typing import Any

from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.model_parts.hyper_connections import HyperConnections
from dsl_lit.config.model_parts.moe import HashRoutedMoE
from dsl_lit.config.model_parts.mtp import MultiTokenPrediction
from dsl_lit.config.model_parts.v4_attention import V4AttentionShape

PRESETS: dict[str, dict[str, Any]] = {
    # transformers 5.24's DeepseekV4Config defaults, documented there as DeepSeek-V4-Flash-Base: 43
    # layers of shared-KV attention (heads of 512, 64 of them rotated), 256 experts (6 active, one
    # shared), sqrt-softplus routing, 3 hash-routed layers, 4 mHC streams, one MTP module (its
    # num_nextn_predict_layers; transformers does not build it). The compressed layers'
    # YaRN (rope_scaling) is left unset, as in that default.
    "deepseek_v4_flash": dict(
        vocab_size=129280, n_layers=43, d_model=4096, n_heads=64, attention_head_dim=512, q_lora_rank=1024,
        qk_rope_head_dim=64, n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, moe_ffn_hidden=2048,
        score_func="sqrtsoftplus", route_scale=1.5, norm_topk_prob=True, max_seq_len=1048576, rope_theta=10000.0,
        compress_rope_theta=160000.0, csa_rate=4, hca_rate=128, sliding_window=128, o_groups=8, o_lora_rank=1024,
        index_n_heads=64, index_head_dim=128, index_topk=512, n_hash_layers=3, swiglu_limit=10.0, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, init_std=0.02, index_training="sparse", mtp_depth=1,
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

CARD = FamilyCard(
    name="deepseek_v4", presets=PRESETS, base_preset="deepseek_v4_tiny", attention=V4AttentionShape,
    moe=HashRoutedMoE(),
    mtp=MultiTokenPrediction(),  # the release's MTPBlock (V4MTPModule); the tiny preset builds none unless asked
    hyper_connections=HyperConnections(),
    unsupported_parallel={
        "sequence_parallel": "its hc_mult residual streams are not sharded over the sequence yet"},
    split_over_tp=("n_heads", "o_groups"),  # the grouped output projection splits by whole groups of heads
    ignores=("ffn_hidden",),
)
