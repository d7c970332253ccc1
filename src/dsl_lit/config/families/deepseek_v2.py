"""DeepSeek-V2 (arXiv 2405.04434): DeepSeek-V3's blocks with softmax routing and no multi-token
prediction (its modules live beside V3's: ``models/deepseek_v3/v2.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from data_contract.errors import ConfigError
from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.model_parts.attention import LatentAttentionShape
from dsl_lit.config.model_parts.moe import DeepSeekMoE

if TYPE_CHECKING:
    from dsl_lit.config.model import ModelConfig

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V2 (arXiv 2405.04434, section 3.1; the released config.json): 236B total, 21B
    # activated; 160 routed experts in 8 device groups, each token limited to 3 devices; before
    # the YaRN context extension, like deepseek_v3_671b.
    "deepseek_v2_236b": dict(
        vocab_size=102400, n_layers=60, d_model=5120, n_heads=128, n_kv_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_dense_layers=1,
        ffn_hidden=12288, n_routed_experts=160, n_shared_experts=2, n_activated_experts=6, moe_ffn_hidden=1536,
        n_expert_groups=8, n_limited_groups=3, score_func="softmax", route_scale=16.0, norm_topk_prob=False,
        seq_balance_alpha=0.003, max_seq_len=4096,
    ),
    # A CPU-sized V2: low-rank queries, 16 experts in 4 groups of which 2 are searched, 2 shared.
    "deepseek_v2_tiny": dict(
        vocab_size=8192, n_layers=4, d_model=256, n_heads=8, n_kv_heads=8, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_dense_layers=1, ffn_hidden=688,
        n_routed_experts=16, n_shared_experts=2, n_activated_experts=4, moe_ffn_hidden=128, n_expert_groups=4,
        n_limited_groups=2, score_func="softmax", route_scale=1.0, norm_topk_prob=False,
        seq_balance_alpha=0.003, max_seq_len=1024,
    ),
}


def _no_mtp(cfg: ModelConfig, prefix: str) -> None:
    """A config built directly (not through a preset's overrides, where the field is refused as unused)."""
    if cfg.mtp_depth:
        raise ConfigError(
            f"{prefix}.mtp_depth={cfg.mtp_depth!r}: the deepseek_v2 family has no multi-token prediction; "
            f"set {prefix}.mtp_depth=0 or use a deepseek_v3 preset"
        )


CARD = FamilyCard(
    name="deepseek_v2", presets=PRESETS, base_preset="deepseek_v2_tiny", attention=LatentAttentionShape,
    moe=DeepSeekMoE(score_funcs=("softmax",)), rules=_no_mtp,
)
