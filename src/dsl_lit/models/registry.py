"""The model-family registry: what each family builds, looked up by family id (``ModelConfig.family``).

Every family's ``SPEC`` (:class:`~dsl_lit.models.common.family_spec.FamilySpec`, in its folder) in one
table, imported directly. Everything outside ``dsl_lit.models`` asks the spec (or the ``ModelConfig``
properties that ask the family's card in ``dsl_lit.config.families``) and never compares a family id;
adding a family is its card (``config/families/``), its folder here and one line in :data:`SPECS`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.families import family_card, family_names
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.family_spec import FamilySpec
from dsl_lit.models.common.hf_adapter import HFAdapter
from dsl_lit.models.deepseek_llm.spec import SPEC as DEEPSEEK_LLM
from dsl_lit.models.deepseek_v3.spec import SPEC as DEEPSEEK_V3
from dsl_lit.models.deepseek_v3.v2 import SPEC as DEEPSEEK_V2
from dsl_lit.models.deepseek_v3.v32 import SPEC as DEEPSEEK_V32
from dsl_lit.models.deepseek_v4.spec import SPEC as DEEPSEEK_V4

SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in (DEEPSEEK_LLM, DEEPSEEK_V3, DEEPSEEK_V2, DEEPSEEK_V32,
                                                                 DEEPSEEK_V4)}
"""Family id -> what it builds; every family of ``dsl_lit.config.families`` has one."""
if set(SPECS) != set(family_names()):
    raise TypeError(f"families without a spec or a card: {sorted(set(SPECS) ^ set(family_names()))}")


def family_spec(name: str, prefix: str = "model") -> FamilySpec:
    """The spec of family ``name``; ConfigError naming ``<prefix>.family`` if there is none."""
    family_card(name, prefix)
    return SPECS[name]


def spec_of(cfg: ModelConfig) -> FamilySpec:
    """The spec of ``cfg``'s family."""
    return family_spec(cfg.family)


@cache
def _readers() -> dict[str, HFAdapter]:
    out: dict[str, HFAdapter] = {}
    for spec in SPECS.values():
        for adapter in spec.hf_readers:
            if adapter.model_type in out:
                raise ValueError(f"two families read Hugging Face model_type {adapter.model_type!r}")
            out[adapter.model_type] = adapter
    return out


def hf_reader(model_type: Any) -> HFAdapter:
    """The adapter that reads Hugging Face checkpoints of ``model_type`` (config.json)."""
    readers = _readers()
    if model_type not in readers:
        raise ConfigError(
            f"config.json model_type={model_type!r} is not supported; supported model types: {sorted(readers)}"
        )
    return readers[model_type]
