"""The family table: every family id (``ModelConfig.family``) and its card, without torch.

A family's card (:class:`~dsl_lit.config.families.card.FamilyCard`) is the parts its model config
is made of (``config/model_parts/``), its presets and its own rules. What the family builds (its
modules, tensor-parallel plan, Hugging Face adapters) is its ``FamilySpec`` in
``dsl_lit.models.registry``, which names the card: models read this table, this table knows no model.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.families import deepseek_llm, deepseek_v2, deepseek_v3, deepseek_v4, deepseek_v32
from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.model_parts.attention import (
    GroupedQueryShape,
    LatentAttentionShape,
    SparseLatentAttentionShape,
)
from dsl_lit.config.model_parts.hyper_connections import HyperConnections
from dsl_lit.config.model_parts.moe import DeepSeekMoE, HashRoutedMoE
from dsl_lit.config.model_parts.mtp import MultiTokenPrediction
from dsl_lit.config.model_parts.part import ModelPart
from dsl_lit.config.model_parts.v4_attention import V4AttentionShape

CARDS: dict[str, FamilyCard] = {card.name: card for card in (
    deepseek_llm.CARD, deepseek_v3.CARD, deepseek_v2.CARD, deepseek_v32.CARD, deepseek_v4.CARD)}
"""Family id -> its card."""

DEFAULT_FAMILY = "deepseek_llm"
"""The family of a ``ModelConfig()`` that names none."""

PART_KINDS: tuple[ModelPart, ...] = (GroupedQueryShape, LatentAttentionShape, DeepSeekMoE(), MultiTokenPrediction(),
                                     SparseLatentAttentionShape, V4AttentionShape, HashRoutedMoE(), HyperConnections())
"""Every part kind, in the order a field's owner is named in messages (the first that reads it)."""


def family_names() -> tuple[str, ...]:
    return tuple(CARDS)


def family_card(name: str, prefix: str = "model") -> FamilyCard:
    """The card of family ``name``; ConfigError naming ``<prefix>.family`` if there is none."""
    if name not in CARDS:
        raise ConfigError(f"{prefix}.family={name!r} is unknown; choose one of {family_names()}")
    return CARDS[name]


def part_fields() -> tuple[str, ...]:
    """Every field some part reads (the rest every model has), in a stable order."""
    return tuple(dict.fromkeys(name for part in PART_KINDS for name in part.FIELDS))


def owner(name: str) -> ModelPart:
    """The first part kind that reads field ``name`` (for messages)."""
    return next(part for part in PART_KINDS if name in part.FIELDS)


@cache
def presets() -> dict[str, dict[str, Any]]:
    """Every family's presets: name -> field values, ``family`` included."""
    out: dict[str, dict[str, Any]] = {}
    for name, card in CARDS.items():
        for preset, values in card.presets.items():
            if preset in out:
                raise ValueError(f"preset {preset!r} is defined by two families ({out[preset]['family']}, {name})")
            out[preset] = {"family": name, **values}
    return out
