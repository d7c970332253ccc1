"""Options of ``recipes/passkey.py``: which checkpoint, at which lengths and key depths, with
which RoPE scaling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import YARN_KEYS


@dataclass
class PasskeyConfig:
    checkpoint: str | None = None
    """One of our checkpoints (step-<N> or run directory) or a Hugging Face directory."""
    tokenizer_dir: str | None = None
    lengths: list[int] = field(default_factory=lambda: [128, 512, 2048])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    per_depth: int = 20
    seed: int = 0
    rope_scaling: dict[str, Any] | None = None
    """Evaluate under this YaRN scaling instead of the checkpoint's (YaRN without training)."""
    device: str = "cpu"

    def validate(self) -> PasskeyConfig:
        if not self.checkpoint:
            raise ConfigError("checkpoint= is required: a step-<N> or run directory, or a Hugging Face directory")
        if not self.lengths or min(self.lengths) < 48:
            raise ConfigError(f"lengths={self.lengths} must be non-empty, each at least 48 tokens (one prompt)")
        if any(not 0.0 <= d <= 1.0 for d in self.depths) or not self.depths:
            raise ConfigError(f"depths={self.depths} must be fractions in [0, 1]")
        if self.per_depth < 1:
            raise ConfigError(f"per_depth={self.per_depth} must be at least 1")
        if self.rope_scaling is not None:
            unknown = sorted(set(self.rope_scaling) - set(YARN_KEYS))
            if unknown:
                raise ConfigError(f"rope_scaling.{unknown[0]} is unknown; YaRN keys are {YARN_KEYS}")
        return self
