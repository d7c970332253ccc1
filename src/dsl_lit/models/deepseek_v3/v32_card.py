"""DeepSeek-V3.2's card: its presets and field checks, without torch (``dsl_lit.models.families``);
what it builds is ``v32.py``."""

from __future__ import annotations

from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import INDEX_TRAINING, INDEXER_FIELDS, ModelConfig
from dsl_lit.models.common.attention_shape import SparseLatentAttentionShape
from dsl_lit.models.deepseek_v3 import validation as v3
from dsl_lit.models.deepseek_v3.presets import PRESETS as V3_PRESETS
from dsl_lit.models.families import FamilyCard

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


def validate(cfg: ModelConfig, prefix: str) -> None:
    """The V3 family's checks, plus the indexer's: it reads MLA's query latent and rotates its first
    ``qk_rope_head_dim`` dims."""
    v3.validate(cfg, prefix)
    if cfg.q_lora_rank is None:
        raise ConfigError(f"{prefix}.q_lora_rank=null: DeepSeek Sparse Attention's indexer reads the query "
                          "latent; set a q_lora_rank")
    for name in ("index_n_heads", "index_head_dim", "index_topk"):  # positive integers
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{prefix}.{name}={value!r} must be a positive integer")
    if cfg.index_training not in INDEX_TRAINING:
        raise ConfigError(f"{prefix}.index_training={cfg.index_training!r} is unknown; choose one of {INDEX_TRAINING}")
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise ConfigError(f"{prefix}.index_head_dim={cfg.index_head_dim} is below qk_rope_head_dim="
                          f"{cfg.qk_rope_head_dim}: the indexer rotates its first qk_rope_head_dim dims")


CARD = FamilyCard(
    name="deepseek_v32",
    presets=PRESETS,
    base_preset="deepseek_v32_tiny",
    attention=SparseLatentAttentionShape,
    moe=True,
    mtp=True,
    validate=validate,
    spec_module="dsl_lit.models.deepseek_v3.v32",
    sparse_attention=True,
    continues="deepseek_v3",  # DeepSeek-V3.2-Exp: continued pretraining of a V3 checkpoint
    added_fields=INDEXER_FIELDS,
)
