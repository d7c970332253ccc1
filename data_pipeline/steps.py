"""Which steps each stage runs, over which units, and what in the config their outputs depend on.

Why a table: the runner, the ``plan`` listing and the scheduler documentation all read it, so the
order of steps and the settings that fingerprint them are written down once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from data_pipeline.config import PipelineConfig


@dataclass(frozen=True)
class Step:
    name: str
    stage: str
    run_unit: Callable[[Any, int], dict[str, Any]]
    units: str  # "shards": one per document shard | "bands" | "partitions" | "one"
    writes_documents: bool = False
    settings: Any = None  # what the outputs depend on besides the inputs (fingerprinted)

    def num_units(self, cfg: PipelineConfig, num_shards: int) -> int:
        if self.units == "shards":
            return num_shards
        if self.units == "bands":
            from data_pipeline.near_dedup import lsh_shape

            return lsh_shape(cfg.near_dedup)[0]
        if self.units == "partitions":
            return cfg.exact_dedup.partitions
        return 1


def steps_for(cfg: PipelineConfig) -> list[Step]:
    """The steps of a run: ingest, the document stages in the order given, finalize, tokenizer stages."""
    from data_pipeline import (
        exact_dedup,
        finalize,
        ingest,
        language_filter,
        near_dedup,
        normalize,
        quality_filter,
        remix,
        tokenizer_stages,
    )

    steps = [Step("ingest", "ingest", ingest.run_unit, "shards", True)]
    for stage in cfg.stages:
        settings = asdict(getattr(cfg, stage)) if stage not in ("train_tokenizer", "tokenize_pack") else None
        if stage == "normalize":
            steps.append(Step("normalize", stage, normalize.run_unit, "shards", True, settings))
        elif stage == "exact_dedup":
            steps += [
                Step("exact_dedup.hash", stage, exact_dedup.hash_unit, "shards", False, settings),
                Step("exact_dedup.resolve", stage, exact_dedup.resolve_unit, "partitions", False, settings),
                Step("exact_dedup", stage, exact_dedup.apply_unit, "shards", True, settings),
            ]
        elif stage == "near_dedup":
            steps += [
                Step("near_dedup.signatures", stage, near_dedup.signatures_unit, "shards", False, settings),
                Step("near_dedup.buckets", stage, near_dedup.buckets_unit, "bands", False, settings),
                Step("near_dedup.cluster", stage, near_dedup.cluster_unit, "one", False, settings),
                Step("near_dedup", stage, near_dedup.apply_unit, "shards", True, settings),
            ]
            if cfg.near_dedup.save_index:
                steps.append(
                    Step("near_dedup.save_index", stage, near_dedup.save_index_unit, "one", False, settings)
                )
        elif stage == "quality_filter":
            steps.append(Step("quality_filter", stage, quality_filter.run_unit, "shards", True, settings))
        elif stage == "language_filter":
            steps.append(Step("language_filter", stage, language_filter.run_unit, "shards", True, settings))
        elif stage == "remix":
            steps += [
                Step("remix.weigh", stage, remix.weigh_unit, "shards", False, settings),
                Step("remix.plan", stage, remix.plan_unit, "one", False, settings),
                Step("remix", stage, remix.apply_unit, "shards", True, settings),
            ]
    steps.append(Step("finalize", "finalize", finalize.run_unit, "one"))
    if "train_tokenizer" in cfg.stages:
        steps.append(
            Step(
                "train_tokenizer",
                "train_tokenizer",
                tokenizer_stages.train_unit,
                "one",
                False,
                asdict(cfg.tokenizer),
            )
        )
    if "tokenize_pack" in cfg.stages:
        settings = {"pack": asdict(cfg.pack), "tokenizer": asdict(cfg.tokenizer)}
        steps += [
            Step("tokenize_pack", "tokenize_pack", tokenizer_stages.pack_unit, "shards", False, settings),
            Step("tokenize_pack.merge", "tokenize_pack", tokenizer_stages.merge_unit, "one", False, settings),
        ]
    return steps
