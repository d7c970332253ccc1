"""The family table: every family id (``ModelConfig.family``) and its card, without torch.

A family's card (:class:`FamilyCard`, ``CARD`` in the module :data:`_FAMILY_CARDS` names) says what
a config needs to know about the family: its presets, the checks of its fields, its attention
shape (``models/common/attention_shape.py``), whether it has a router and MTP. It imports no
torch, so ``dsl_lit.config`` builds and validates a ``ModelConfig`` through it without loading the
model code. What the family builds (its modules, tensor-parallel plan, Hugging Face adapters) is
its ``FamilySpec`` (``dsl_lit.models.registry``), in the module the card names.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.attention_shape import AttentionShape

_FAMILY_CARDS: dict[str, str] = {
    "deepseek_llm": "dsl_lit.models.deepseek_llm.card",
    "deepseek_v3": "dsl_lit.models.deepseek_v3.card",
    "deepseek_v2": "dsl_lit.models.deepseek_v3.v2_card",
    "deepseek_v32": "dsl_lit.models.deepseek_v3.v32_card",
    "deepseek_v4": "dsl_lit.models.deepseek_v4.card",
}
"""Family id -> the module holding its ``CARD``."""

DEFAULT_FAMILY = "deepseek_llm"
"""The family of a ``ModelConfig()`` that names none."""


@dataclass(frozen=True)
class FamilyCard:
    """What a config needs to know about one model family (no torch)."""

    name: str
    """The family id, ``ModelConfig.family``."""
    presets: Mapping[str, Mapping[str, Any]]
    """Preset name -> field values (``ModelConfig.from_name``; the family is added)."""
    base_preset: str
    """The preset a config from elsewhere (a Hugging Face directory) is recorded under, every field
    overridden, so that ``ModelConfig.from_name`` rebuilds it."""
    attention: AttentionShape
    """The shape of its attention (the module its spec builds answers the same)."""
    moe: bool
    """Whether blocks from ``n_dense_layers`` on are DeepSeekMoE (the spec's composition has a router)."""
    mtp: bool
    """Whether the family builds ``mtp_depth`` multi-token-prediction modules (else it ignores the field)."""
    validate: Callable[[ModelConfig, str], None]
    """Raise ConfigError naming ``<prefix>.<field>`` for the family's fields (the fields every family
    shares are checked by ``ModelConfig.validate``)."""
    spec_module: str
    """The module holding the family's ``SPEC`` (``dsl_lit.models.registry.FamilySpec``; imports torch)."""
    sparse_attention: bool = False
    """Whether its attention has DeepSeek Sparse Attention's lightning indexer (the ``index_*`` fields)."""
    continues: str | None = None
    """A family whose checkpoints this one starts from (``init_from``), adding its own modules
    (DeepSeek-V3.2 continues DeepSeek-V3's pretraining with the indexers added)."""
    added_fields: tuple[str, ...] = ()
    """The fields of those added modules, taken from the run's model config."""
    unsupported_parallel: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Parallel dimensions (``tp``, ``pp``, ``cp``, ``ep``) the family cannot run under, each with why:
    ``TrainConfig.validate`` refuses them before any process starts."""
    split_over_tp: tuple[str, ...] = ("n_heads",)
    """Fields tensor parallelism divides over its ranks (the attention's heads; DeepSeek-V4 also its
    output projection's groups of heads): ``parallel.tp`` must divide each."""
    packed_documents: bool = True
    """Whether its attention follows packed documents (a per-query key mask); False: SFT must not pack."""
    reads: tuple[str, ...] = ()
    """Set: every field of the optional groups (grouped-query, MLA, MoE, MTP, indexer, V4 blocks:
    ``config/model.py``) it reads, the rest of them unused; empty: the flags above decide (and the
    V4 block fields are unused)."""
    ignores: tuple[str, ...] = ()
    """Fields beyond those its flags rule out that it never reads (a value there is refused)."""


def family_names() -> tuple[str, ...]:
    return tuple(_FAMILY_CARDS)


@cache
def _load(name: str) -> FamilyCard:
    card = importlib.import_module(_FAMILY_CARDS[name]).CARD
    if not isinstance(card, FamilyCard) or card.name != name:
        raise TypeError(f"{_FAMILY_CARDS[name]}.CARD must be the FamilyCard named {name!r}")
    return card


def family_card(name: str, prefix: str = "model") -> FamilyCard:
    """The card of family ``name``; ConfigError naming ``<prefix>.family`` if there is none."""
    if name not in _FAMILY_CARDS:
        raise ConfigError(f"{prefix}.family={name!r} is unknown; choose one of {family_names()}")
    return _load(name)


@cache
def presets() -> dict[str, dict[str, Any]]:
    """Every family's presets: name -> field values, ``family`` included."""
    out: dict[str, dict[str, Any]] = {}
    for name in family_names():
        for preset, values in _load(name).presets.items():
            if preset in out:
                raise ValueError(f"preset {preset!r} is defined by two families ({out[preset]['family']}, {name})")
            out[preset] = {"family": name, **values}
    return out


def continued_config(checkpoint: ModelConfig, run: ModelConfig) -> ModelConfig | None:
    """The architecture a run of ``run``'s family starts from a ``checkpoint`` of another family
    with, when its card ``continues`` that family (DeepSeek-V3.2 from DeepSeek-V3: the checkpoint's
    shape, ``run``'s family and the fields of the modules it adds); None when it does not."""
    card = family_card(run.family)
    if card.continues is None or card.continues != checkpoint.family:
        return None
    values = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint)}
    values.update(name=card.base_preset, family=card.name, **{name: getattr(run, name) for name in card.added_fields})
    return ModelConfig(**values).validate()
