"""The model-family registry: the one place a family id (``ModelConfig.family``) is looked up.

A family is a folder under ``dsl_lit.models`` whose module exposes ``SPEC``, a :class:`FamilySpec`:
its presets, its composition (which attention, which router, MTP or not), its validation, its
tensor-parallel plan (as data), its Hugging Face adapters. Its FLOPs and pipeline stage costs
follow from the composition. Everything outside ``dsl_lit.models`` asks the spec (or the
``ModelConfig`` properties that ask it) and never compares a family id; adding a family is one
folder (or one module in a related family's folder) plus one line in :data:`_FAMILY_MODULES`.
(torchtitan keeps a ``TrainSpec`` per model folder the same way.)

``dsl_lit.config`` imports this module only when a config is validated or asked a family question
(``ModelConfig._family``), never when it is itself imported; a family's module is imported the
first time that family is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from dsl_lit.config.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.flops import DecoderFlops
from dsl_lit.models.common.hf_adapter import HFAdapter
from dsl_lit.models.common.tp_plan import Plan
from dsl_lit.models.common.transformer import Transformer

_FAMILY_MODULES: dict[str, str] = {
    "deepseek_llm": "dsl_lit.models.deepseek_llm",
    "deepseek_v3": "dsl_lit.models.deepseek_v3",
    "deepseek_v2": "dsl_lit.models.deepseek_v3.v2",
}
"""Family id -> the module holding its ``SPEC``."""

DEFAULT_FAMILY = "deepseek_llm"
"""The family of a ``ModelConfig()`` that names none."""


@dataclass(frozen=True)
class FamilySpec:
    """Everything the rest of dsl-lit needs to know about one model family."""

    name: str
    """The family id, ``ModelConfig.family``."""
    presets: Mapping[str, Mapping[str, Any]]
    """Preset name -> field values (``ModelConfig.from_name``; the family is added)."""
    base_preset: str
    """The preset a config from elsewhere (a Hugging Face directory) is recorded under, every field
    overridden, so that ``ModelConfig.from_name`` rebuilds it."""
    composition: Composition
    validate: Callable[[ModelConfig, str], None]
    """Raise ConfigError naming ``<prefix>.<field>`` for the family's fields (the fields every family
    shares are checked by ``ModelConfig.validate``)."""
    tp_plan: Callable[[ModelConfig, int, bool], Plan]
    """``(cfg, tp, sequence_parallel) -> {module FQN: style name}`` (``dsl_lit.models.common.tp_plan``)."""
    hf_adapter: HFAdapter
    """Writes this family's models as a Hugging Face checkpoint."""
    hf_readers: tuple[HFAdapter, ...]
    """Read Hugging Face checkpoints (by ``model_type``) into this family."""

    def build(self, cfg: ModelConfig) -> Transformer:
        return Transformer(cfg, self.composition)

    @property
    def flops(self) -> DecoderFlops:
        """Matmul weights and training FLOPs per token; pipeline stages are balanced on them."""
        return DecoderFlops(self.composition.attention)

    @property
    def latent_attention(self) -> bool:
        return self.composition.attention.latent

    @property
    def moe(self) -> bool:
        return self.composition.router is not None

    @property
    def mtp(self) -> bool:
        return self.composition.mtp


@cache
def _load(name: str) -> FamilySpec:
    spec = importlib.import_module(_FAMILY_MODULES[name]).SPEC
    if not isinstance(spec, FamilySpec) or spec.name != name:
        raise TypeError(f"{_FAMILY_MODULES[name]}.SPEC must be the FamilySpec named {name!r}")
    return spec


def family_names() -> tuple[str, ...]:
    return tuple(_FAMILY_MODULES)


def family_spec(name: str, prefix: str = "model") -> FamilySpec:
    """The spec of family ``name``; ConfigError naming ``<prefix>.family`` if there is none."""
    if name not in _FAMILY_MODULES:
        raise ConfigError(f"{prefix}.family={name!r} is unknown; choose one of {family_names()}")
    return _load(name)


def spec_of(cfg: ModelConfig) -> FamilySpec:
    """The spec of ``cfg``'s family."""
    return family_spec(cfg.family)


@cache
def presets() -> dict[str, dict[str, Any]]:
    """Every family's presets: name -> field values, ``family`` included."""
    out: dict[str, dict[str, Any]] = {}
    for name in family_names():
        spec = _load(name)
        for preset, values in spec.presets.items():
            if preset in out:
                raise ValueError(f"preset {preset!r} is defined by two families ({out[preset]['family']}, {name})")
            out[preset] = {"family": name, **values}
    return out


@cache
def _readers() -> dict[str, HFAdapter]:
    out: dict[str, HFAdapter] = {}
    for name in family_names():
        for adapter in _load(name).hf_readers:
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
