"""Pure-PyTorch DeepSeek models. Nothing here imports Lightning or knows about parallelism.

``common/`` holds the layers every family shares, one folder per family (``deepseek_llm/``,
``deepseek_v3/`` with DeepSeek-V2 and V3.2 beside V3, ``deepseek_v4/``) holds what makes it that
family, and :mod:`dsl_lit.models.registry` says what each family builds. What a config knows of a
family (its parts, presets and rules) is ``dsl_lit.config.families``, below this package.

Importing this package loads no torch: :func:`build_model` and the names of :data:`_LAZY` import
the model code on first use, so torch-free callers (FLOPs, the planner) can import ``ModelConfig`` here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dsl_lit.config.model import ModelConfig

if TYPE_CHECKING:
    from dsl_lit.models.common.family_spec import FamilySpec
    from dsl_lit.models.common.transformer import Transformer
    from dsl_lit.models.registry import family_spec, spec_of

_LAZY = {
    "Transformer": "dsl_lit.models.common.transformer",
    "FamilySpec": "dsl_lit.models.common.family_spec",
    "family_spec": "dsl_lit.models.registry",
    "spec_of": "dsl_lit.models.registry",
}
"""Name -> the module (importing torch) that defines it."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def build_model(cfg: ModelConfig) -> Transformer:
    """The one constructor every recipe uses: the decoder of ``cfg``'s family."""
    from dsl_lit.models.registry import spec_of

    return spec_of(cfg).build(cfg)


__all__ = ["FamilySpec", "ModelConfig", "Transformer", "build_model", "family_spec", "spec_of"]
