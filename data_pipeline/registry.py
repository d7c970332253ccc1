"""Every stage that ``stages=[...]`` may name, in one table: adding a stage is one line here.

Why a plain mapping: the config loader, the validation of ``stages`` and the runner all read it,
and listing the classes explicitly keeps the set of stages greppable (no import-time magic).
"""

from __future__ import annotations

from data_pipeline.stage import Stage
from data_pipeline.stages.decontaminate import Decontaminate
from data_pipeline.stages.exact_dedup import ExactDedup
from data_pipeline.stages.language_filter import LanguageFilter
from data_pipeline.stages.near_dedup import NearDedup
from data_pipeline.stages.normalize import Normalize
from data_pipeline.stages.quality_filter import QualityFilter
from data_pipeline.stages.remix import Remix
from data_pipeline.stages.tokenize_pack import TokenizePack
from data_pipeline.stages.train_tokenizer import TrainTokenizer

STAGES: dict[str, type[Stage]] = {
    stage.name: stage
    for stage in (
        Normalize,
        ExactDedup,
        NearDedup,
        QualityFilter,
        LanguageFilter,
        Decontaminate,
        Remix,
        TrainTokenizer,
        TokenizePack,
    )
}
