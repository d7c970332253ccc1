"""Pure-PyTorch DeepSeek models. Nothing here imports Lightning or knows about parallelism.

``common/`` holds the layers every family shares, one folder per family (``deepseek_llm/``,
``deepseek_v3/``, with DeepSeek-V2 beside V3) holds what makes it that family, and
:mod:`dsl_lit.models.registry` is the one place a family id is looked up.
"""

from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.transformer import Transformer
from dsl_lit.models.registry import FamilySpec, family_spec, spec_of


def build_model(cfg: ModelConfig) -> Transformer:
    """The one constructor every recipe uses: the decoder of ``cfg``'s family."""
    return spec_of(cfg).build(cfg)


__all__ = ["FamilySpec", "ModelConfig", "Transformer", "build_model", "family_spec", "spec_of"]
