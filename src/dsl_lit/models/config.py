"""Model configuration: one dataclass for every DeepSeek family, plus named presets.

Presets carry the numbers from the papers (see DESIGN.md section 2); ``ModelConfig.from_name``
builds one and lets any field be overridden, which is what the Hydra ``model`` group does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from dsl_lit.errors import ConfigError

AttentionBackend = Literal["sdpa", "flash_attn", "eager"]
ATTENTION_BACKENDS = ("sdpa", "flash_attn", "eager")


@dataclass
class ModelConfig:
    """Architecture hyperparameters. ``family`` selects which blocks the decoder is built from."""

    name: str = "custom"
    family: Literal["deepseek_llm"] = "deepseek_llm"
    vocab_size: int = 102400
    n_layers: int = 30
    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 32
    ffn_hidden: int = 11008
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.006
    tie_embeddings: bool = False
    attn_backend: AttentionBackend = "sdpa"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self, prefix: str = "model") -> ModelConfig:
        """Raise ConfigError naming ``model.<field>`` for values the model cannot be built with."""
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{prefix}.{name}={value!r} must be a positive integer")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"{prefix}.n_heads={self.n_heads} does not divide {prefix}.d_model={self.d_model}; "
                "pick n_heads so that d_model / n_heads is an integer head dimension"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"{prefix}.n_kv_heads={self.n_kv_heads} does not divide {prefix}.n_heads={self.n_heads}; "
                "grouped-query attention needs n_heads to be a multiple of n_kv_heads"
            )
        if self.head_dim % 2:
            raise ConfigError(f"{prefix}: head_dim={self.head_dim} must be even for rotary embeddings")
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"{prefix}.attn_backend={self.attn_backend!r} is unknown; choose one of {ATTENTION_BACKENDS}"
            )
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ConfigError(f"{prefix}.norm_eps, init_std and rope_theta must be > 0")
        return self

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig:
        """Build a preset by name, with field overrides (unknown fields raise ConfigError)."""
        if name not in PRESETS:
            raise ConfigError(f"model.name={name!r} is not a known preset; choose one of {sorted(PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"model.{unknown[0]} is not a ModelConfig field; known fields: {sorted(known)}")
        values = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
        return cls(name=name, **values).validate()


PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek LLM (arXiv 2401.02954, Table 2): LLaMA-style pre-norm decoder, 102400 vocab.
    "deepseek_llm_7b": dict(
        family="deepseek_llm", vocab_size=102400, n_layers=30, d_model=4096, n_heads=32, n_kv_heads=32,
        ffn_hidden=11008, max_seq_len=4096,
    ),
    "deepseek_llm_67b": dict(
        family="deepseek_llm", vocab_size=102400, n_layers=95, d_model=8192, n_heads=64, n_kv_heads=8,
        ffn_hidden=22016, max_seq_len=4096,
    ),
    # A few million parameters: trains on two CPU cores in minutes. GQA so the grouped path is exercised.
    "deepseek_llm_tiny": dict(
        family="deepseek_llm", vocab_size=8192, n_layers=4, d_model=256, n_heads=8, n_kv_heads=4,
        ffn_hidden=688, max_seq_len=1024,
    ),
    # ~100M parameters: the benchmark's "small but real" size.
    "deepseek_llm_100m": dict(
        family="deepseek_llm", vocab_size=32768, n_layers=12, d_model=640, n_heads=10, n_kv_heads=10,
        ffn_hidden=1728, max_seq_len=2048,
    ),
}
