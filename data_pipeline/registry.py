"""Every stage that ``stages=[...]`` may name, in one table: adding a stage is one line here.

Why a plain mapping: the config loader, the validation of ``stages`` and the runner all read it,
and listing the classes explicitly keeps the set of stages greppable (no import-time magic).
"""

from __future__ import annotations

from data_pipeline.decontaminate import Decontaminate
from data_pipeline.exact_dedup import ExactDedup
from data_pipeline.language_filter import LanguageFilter
from data_pipeline.near_dedup import NearDedup
from data_pipeline.normalize import Normalize
from data_pipeline.quality_filter import QualityFilter
from data_pipeline.remix import Remix
from data_pipeline.stage import Stage
from data_pipeline.tokenize_pack import TokenizePack
from data_pipeline.train_tokenizer import TrainTokenizer

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
