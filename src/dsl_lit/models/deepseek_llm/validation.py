"""The fields DeepSeek LLM uses beyond the shared ones: grouped-query attention's head layout."""

from __future__ import annotations

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig


def validate(cfg: ModelConfig, prefix: str) -> None:
    """ConfigError naming ``<prefix>.<field>`` when the heads do not tile ``d_model`` or the kv heads."""
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
