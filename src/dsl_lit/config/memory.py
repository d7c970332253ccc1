"""The ``memory`` config group: activation recompute and the EMA of weights."""

from __future__ import annotations

from dataclasses import dataclass

from data_contract.errors import ConfigError

MODES = ("none", "selective", "full")
"""Activation recompute modes (:mod:`dsl_lit.memory.recompute`)."""


@dataclass
class MemoryConfig:
    """``recompute``: none | selective | full (see :mod:`dsl_lit.memory.recompute`), on the block
    indices in ``recompute_blocks`` (null: every block). ``ema_decay``: keep an exponential moving
    average of the weights in CPU memory (DeepSeek-V3 section 3.2.3), updated every
    ``ema_every_n_steps`` steps; 0 disables it. ``validate_with_ema`` evaluates the EMA weights."""

    recompute: str = "none"
    recompute_blocks: list[int] | None = None
    ema_decay: float = 0.0
    ema_every_n_steps: int = 1
    validate_with_ema: bool = False

    def validate(self) -> MemoryConfig:
        if self.recompute not in MODES:
            raise ConfigError(f"memory.recompute={self.recompute!r} is unknown; choose one of {list(MODES)}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"memory.ema_decay={self.ema_decay} must be in [0, 1) (0 disables the EMA)")
        if self.ema_every_n_steps < 1:
            raise ConfigError(f"memory.ema_every_n_steps={self.ema_every_n_steps} must be >= 1")
        if self.validate_with_ema and not self.ema_decay:
            raise ConfigError("memory.validate_with_ema=true needs an EMA: set memory.ema_decay, e.g. 0.999")
        return self
