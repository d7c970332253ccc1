"""The model-family registry: what each family builds, looked up by family id (``ModelConfig.family``).

A family is a folder under ``dsl_lit.models``: its card (:mod:`dsl_lit.models.families`, no
torch: presets, field checks, attention shape, router and MTP or not) names the module whose
``SPEC`` is a :class:`FamilySpec`: its composition (which attention module, which router), its
tensor-parallel plan (as data), its Hugging Face adapters. Its FLOPs and pipeline stage costs
follow from the composition. Everything outside ``dsl_lit.models`` asks the spec (or the
``ModelConfig`` properties that ask the card) and never compares a family id; adding a family is one
folder (or modules in a related family's folder) plus one line in ``families._FAMILY_CARDS``.
(torchtitan keeps a ``TrainSpec`` per model folder the same way.)

``dsl_lit.config`` never imports this module (it asks :mod:`dsl_lit.models.families`); a family's
spec is imported the first time that family is built or asked for what it builds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.flops import DecoderFlops
from dsl_lit.models.common.hf_adapter import HFAdapter
from dsl_lit.models.common.tp_plan import Plan
from dsl_lit.models.common.transformer import Transformer
from dsl_lit.models.families import FamilyCard, family_card, family_names


@dataclass(frozen=True)
class FamilySpec:
    """Everything the rest of dsl-lit needs to know about one model family."""

    card: FamilyCard
    """What a config knows of the family (presets, checks, attention shape); the composition agrees."""
    composition: Composition
    tp_plan: Callable[[ModelConfig, int, bool], Plan] | None
    """``(cfg, tp, sequence_parallel) -> {module FQN: style name}`` (``dsl_lit.models.common.tp_plan``);
    None: no tensor-parallel plan (the card lists ``tp`` in ``unsupported_parallel``)."""
    hf_adapter: HFAdapter
    """Writes this family's models as a Hugging Face checkpoint."""
    hf_readers: tuple[HFAdapter, ...]
    """Read Hugging Face checkpoints (by ``model_type``) into this family."""
    model: Callable[[ModelConfig], Transformer] | None = None
    """Builds the family's decoder when its blocks are not the shared :class:`Transformer`'s (DeepSeek-V4's
    residual streams); None: ``Transformer(cfg, composition)``."""

    def __post_init__(self) -> None:
        card, composition = self.card, self.composition
        if not issubclass(composition.attention, card.attention) or (composition.router is not None) != card.moe:
            raise TypeError(f"the {card.name!r} family's composition does not match its card")
        if self.tp_plan is None and "tp" not in card.unsupported_parallel:
            raise TypeError(f"the {card.name!r} family has no tp_plan: its card must refuse parallel.tp")

    @property
    def name(self) -> str:
        """The family id, ``ModelConfig.family``."""
        return self.card.name

    def build(self, cfg: ModelConfig) -> Transformer:
        return self.model(cfg) if self.model is not None else Transformer(cfg, self.composition)

    @property
    def flops(self) -> DecoderFlops:
        """Matmul weights and training FLOPs per token; pipeline stages are balanced on them."""
        return DecoderFlops(self.card.attention)


@cache
def _load(name: str) -> FamilySpec:
    module = family_card(name).spec_module
    spec = importlib.import_module(module).SPEC
    if not isinstance(spec, FamilySpec) or spec.name != name:
        raise TypeError(f"{module}.SPEC must be the FamilySpec named {name!r}")
    return spec


def family_spec(name: str, prefix: str = "model") -> FamilySpec:
    """The spec of family ``name``; ConfigError naming ``<prefix>.family`` if there is none."""
    family_card(name, prefix)
    return _load(name)


def spec_of(cfg: ModelConfig) -> FamilySpec:
    """The spec of ``cfg``'s family."""
    return family_spec(cfg.family)


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
