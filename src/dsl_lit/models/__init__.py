"""Pure-PyTorch DeepSeek models. Nothing here imports Lightning or knows about parallelism."""

from dsl_lit.config.model import PRESETS, ModelConfig
from dsl_lit.models.transformer import Transformer


def build_model(cfg: ModelConfig) -> Transformer:
    """The one constructor every recipe uses; later families dispatch on ``cfg.family`` here."""
    return Transformer(cfg)


__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model"]
