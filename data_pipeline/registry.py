"""Every stage of the pipeline in one table: adding a stage is one line here.

Why a plain tuple: the config loader, the validation of ``stages`` and the runner all read it,
and listing the classes explicitly keeps the set of stages greppable (no import-time magic). Ingest
and finalize are rows like any other: each stage says where it runs (``Stage.phase``) and whether
every run has it (``Stage.always``), so neither the config nor the runner names one.
"""

from __future__ import annotations

from data_pipeline.stage import Stage
from data_pipeline.stages.decontaminate import Decontaminate
from data_pipeline.stages.exact_dedup import ExactDedup
from data_pipeline.stages.finalize import Finalize
from data_pipeline.stages.ingest import Ingest
from data_pipeline.stages.language_filter import LanguageFilter
from data_pipeline.stages.near_dedup import NearDedup
from data_pipeline.stages.normalize import Normalize
from data_pipeline.stages.quality_filter import QualityFilter
from data_pipeline.stages.remix import Remix
from data_pipeline.stages.tokenize_pack import TokenizePack
from data_pipeline.stages.train_tokenizer import TrainTokenizer

ALL_STAGES: tuple[type[Stage], ...] = (
    Ingest,
    Normalize,
    ExactDedup,
    NearDedup,
    QualityFilter,
    LanguageFilter,
    Decontaminate,
    Remix,
    Finalize,
    TrainTokenizer,
    TokenizePack,
)
STAGES: dict[str, type[Stage]] = {stage.name: stage for stage in ALL_STAGES if not stage.always}
"""The stages ``stages=[...]`` may name."""
ALWAYS: tuple[type[Stage], ...] = tuple(stage for stage in ALL_STAGES if stage.always)
"""The stages every run has without naming them."""
