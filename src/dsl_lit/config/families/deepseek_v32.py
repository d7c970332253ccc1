"""DeepSeek-V3.2 (DeepSeek-V3.2-Exp): DeepSeek-V3 with DeepSeek Sparse Attention, a lightning
indexer per layer picking the keys each query attends to; continued pretraining of a V3 checkpoint."""

from __future__ import annotations

from typing import Any

from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.families.deepseek_v3 import PRESETS as V3_PRESETS
from dsl_lit.config.model_parts.attention import INDEXER_FIELDS, SparseLatentAttentionShape
from dsl_lit.config.model_parts.moe import DeepSeekMoE
from dsl_lit.config.model_parts.mtp import MultiTokenPrediction

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3.2-Exp (its released config.json): DeepSeek-V3's 671B shape (continued pretraining
    # of V3.1-Terminus) plus the lightning indexer: 64 heads of 128, each query keeps 2048 keys.
    "deepseek_v32_671b": dict(
        V3_PRESETS["deepseek_v3_671b"], index_n_heads=64, index_head_dim=128, index_topk=2048, max_seq_len=163840,
        rope_scaling={"factor": 40.0, "original_max_seq_len": 4096, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # The CPU-sized V3 with an indexer that keeps 16 keys: sequences longer than 16 are sparse.
    "deepseek_v32_tiny": dict(
        V3_PRESETS["deepseek_v3_tiny"], index_n_heads=4, index_head_dim=32, index_topk=16,
    ),
}

CARD = FamilyCard(
    name="deepseek_v32", presets=PRESETS, base_preset="deepseek_v32_tiny", attention=SparseLatentAttentionShape,
    moe=DeepSeekMoE(score_funcs=("sigmoid", "softmax")), mtp=MultiTokenPrediction(),
    continues="deepseek_v3",  # DeepSeek-V3.2-Exp: continued pretraining of a V3 checkpoint
    added_fields=INDEXER_FIELDS,
)
