"""The multi-token-prediction part (DeepSeek-V3, sec. 2.2; DeepSeek-V4 keeps it): ``mtp_depth``
sequential modules, each predicting one more future token through a block of its own and the shared
embedding and head. What a module is, is the family's (V3: ``models/common/mtp.py``; V4, with its
residual streams: ``models/deepseek_v4/model.py``); how the modules chain and train is one mechanism
(``Transformer.mtp_logits``, the pretraining objective's MTP loss)."""

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
