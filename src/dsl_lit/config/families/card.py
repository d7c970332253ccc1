"""A family's card: the parts its model config is made of, its presets and its own rules (no torch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsl_lit.config.model_parts.attention import AttentionShape, SparseLatentAttentionShape
from dsl_lit.config.model_parts.hyper_connections import HyperConnections
from dsl_lit.config.model_parts.moe import RoutedExperts
from dsl_lit.config.model_parts.mtp import MultiTokenPrediction
from dsl_lit.config.model_parts.part import ModelPart

if TYPE_CHECKING:
    from dsl_lit.config.model import ModelConfig


@dataclass(frozen=True)
class FamilyCard:
    """What a config knows of one model family. What the family builds (modules, tensor-parallel
    plan, Hugging Face adapters) is its ``FamilySpec`` (``dsl_lit.models.registry``), which names
    this card."""

    name: str
    """The family id, ``ModelConfig.family``."""
    presets: Mapping[str, Mapping[str, Any]]
    """Preset name -> field values (``ModelConfig.from_name``; the family is added)."""
    base_preset: str
    """The preset a config from elsewhere (a Hugging Face directory) is recorded under, every field
    overridden, so that ``ModelConfig.from_name`` rebuilds it."""
    attention: type[AttentionShape]
    """Its attention part (the module its spec builds inherits it)."""
    moe: RoutedExperts | None = None
    """Its routed experts; None: every block has a dense FFN."""
    mtp: MultiTokenPrediction | None = None
    """Its multi-token prediction; None: the family builds no MTP module."""
    hyper_connections: HyperConnections | None = None
    """DeepSeek-V4's residual streams; None: one residual stream."""
    rules: Callable[[ModelConfig, str], None] | None = None
    """Checks beyond its parts' (ConfigError naming ``<prefix>.<field>``)."""
    continues: str | None = None
    """A family whose checkpoints this one starts from (``init_from``), adding its own modules
    (DeepSeek-V3.2 continues DeepSeek-V3's pretraining with the indexers added)."""
    added_fields: tuple[str, ...] = ()
    """The fields of those added modules, taken from the run's model config."""
    unsupported_parallel: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Parallel dimensions (``tp``, ``pp``, ``cp``, ``ep``, ``sequence_parallel``) the family cannot run
    under, each with why: ``TrainConfig.validate`` refuses them before any process starts."""
    split_over_tp: tuple[str, ...] = ("n_heads",)
    """Fields tensor parallelism divides over its ranks (the attention's heads; DeepSeek-V4 also its
    output projection's groups of heads): ``parallel.tp`` must divide each."""
    packed_documents: bool = True
    """Whether its attention follows packed documents (a per-query key mask); False: SFT must not pack."""
    ignores: tuple[str, ...] = ()
    """Fields every model has that this family never reads (a value set there is refused)."""

    @property
    def parts(self) -> tuple[ModelPart, ...]:
        """The parts its config is made of (beyond the fields every model has)."""
        return tuple(p for p in (self.attention, self.moe, self.mtp, self.hyper_connections) if p is not None)

    @property
    def sparse_attention(self) -> bool:
        """Whether its attention is DeepSeek Sparse Attention (a lightning indexer picks the keys)."""
        return issubclass(self.attention, SparseLatentAttentionShape)

    def starts_from(self, family: str) -> bool:
        """Whether its runs start from checkpoints of ``family`` (another family) it ``continues``."""
        return self.continues == family

    def reads(self, name: str) -> bool:
        """Whether one of its parts reads field ``name``."""
        return any(name in part.FIELDS for part in self.parts)

    def validate(self, cfg: ModelConfig, prefix: str) -> None:
        """Its parts' checks, then its own rules."""
        for part in self.parts:
            part.validate(cfg, prefix)
        if self.rules is not None:
            self.rules(cfg, prefix)
