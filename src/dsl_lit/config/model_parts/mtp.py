"""The multi-token-prediction part (DeepSeek-V3, sec. 2.2): ``mtp_depth`` sequential modules, each
predicting one more future token through a block of its own and the shared head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dsl_lit.config.model_parts.part import require_ints

if TYPE_CHECKING:
    from dsl_lit.config.model import ModelConfig


@dataclass(frozen=True)
class MultiTokenPrediction:
    FIELDS: ClassVar[tuple[str, ...]] = ("mtp_depth",)
    DESCRIPTION: ClassVar[str] = "multi-token prediction"

    def validate(self, cfg: ModelConfig, prefix: str) -> None:
        require_ints(cfg, prefix, ("mtp_depth",), minimum=0)

    @staticmethod
    def modules(cfg: ModelConfig) -> int:
        """The MTP modules the model builds."""
        return cfg.mtp_depth
