"""DeepSeek-V3 (arXiv 2412.19437): Multi-head Latent Attention, DeepSeekMoE with sigmoid routing
and the balancing bias, multi-token prediction."""

from __future__ import annotations

from typing import Any

from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.model_parts.attention import LatentAttentionShape
from dsl_lit.config.model_parts.moe import DeepSeekMoE
from dsl_lit.config.model_parts.mtp import MultiTokenPrediction

_MLA: dict[str, Any] = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
"""The MLA head layout of the released V2 and V3 models."""

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 (arXiv 2412.19437, section 4.2): 671B total, 37B activated, MTP depth 1.
    "deepseek_v3_671b": dict(
        _MLA, vocab_size=129280, n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128,
        q_lora_rank=1536, n_dense_layers=3, ffn_hidden=18432, n_routed_experts=256, n_shared_experts=1,
        n_activated_experts=8, moe_ffn_hidden=2048, n_expert_groups=8, n_limited_groups=4,
        score_func="sigmoid", route_scale=2.5, norm_topk_prob=True, seq_balance_alpha=0.0001, mtp_depth=1,
        max_seq_len=4096,
    ),
    # DeepSeek-V2-Lite (arXiv 2405.04434): 15.7B total, 2.4B activated; no query compression,
    # softmax routing over 64 experts + 2 shared, no group limit (so V3's router routes it as V2's).
    "deepseek_v2_lite": dict(
        _MLA, vocab_size=102400, n_layers=27, d_model=2048, n_heads=16, n_kv_heads=16,
        q_lora_rank=None, n_dense_layers=1, ffn_hidden=10944, n_routed_experts=64, n_shared_experts=2,
        n_activated_experts=6, moe_ffn_hidden=1408, n_expert_groups=1, n_limited_groups=1,
        score_func="softmax", route_scale=1.0, norm_topk_prob=False, max_seq_len=4096,
    ),
    # A CPU-sized V3 with every mechanism switched on: low-rank queries, node-limited sigmoid
    # routing (4 groups, 2 kept), a shared expert, the balance loss and one MTP module.
    "deepseek_v3_tiny": dict(
        vocab_size=8192, n_layers=4, d_model=256, n_heads=8, n_kv_heads=8,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_dense_layers=1, ffn_hidden=688, n_routed_experts=16, n_shared_experts=1, n_activated_experts=4,
        moe_ffn_hidden=128, n_expert_groups=4, n_limited_groups=2, score_func="sigmoid", route_scale=2.5,
        norm_topk_prob=True, seq_balance_alpha=0.0001, mtp_depth=1, max_seq_len=1024,
    ),
}

CARD = FamilyCard(
    name="deepseek_v3", presets=PRESETS, base_preset="deepseek_v3_tiny", attention=LatentAttentionShape,
    moe=DeepSeekMoE(score_funcs=("sigmoid", "softmax")), mtp=MultiTokenPrediction(),
)
