"""What a model family builds (no lookup here: ``registry.py`` is the table of them).

A family's ``SPEC`` (in its folder) names its card (``dsl_lit.config.families``: the parts of its
config, presets, rules; no torch), its composition (which attention module, which router), its
tensor-parallel plan (as data) and its Hugging Face adapters. Its FLOPs and pipeline stage costs
follow from the composition. (torchtitan keeps a ``TrainSpec`` per model folder the same way.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.model import ModelConfig
from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.flops import DecoderFlops
from dsl_lit.models.common.hf_adapter import HFAdapter
from dsl_lit.models.common.tp_plan import Plan
from dsl_lit.models.common.transformer import Transformer


@dataclass(frozen=True)
class FamilySpec:
    """Everything the rest of dsl-lit needs to know about one model family."""

    card: FamilyCard
    """What a config knows of the family (its parts, presets, rules); the composition agrees."""
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
        if not issubclass(composition.attention, card.attention) or (composition.router is not None) != (card.moe is not None):
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
