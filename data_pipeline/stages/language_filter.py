"""Stage ``language_filter``: keep documents in the listed languages, scored by py3langid.

Why py3langid: its naive Bayes model ships inside the pip package (no download at run time) and it
needs only numpy; :mod:`data_pipeline.filters.language_id` runs it on a whole batch at once with the same
answers and scores. Kept documents carry ``language`` and ``language_score`` columns.
"""

from __future__ import annotations

import dataclasses as dc
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from data_contract.errors import ConfigError
from data_pipeline.context import Context
from data_pipeline.document_step import Verdicts, map_documents, write_split
from data_pipeline.filters.language_id import batch_identifier
from data_pipeline.io.shards import read_documents, shard_file
from data_pipeline.stage import Stage, Step, check_fraction

MAX_CHARS = 10_000  # the first 10k characters decide; enough for a stable answer on long pages


@dataclass
class LanguageFilterConfig:
    languages: list[str] = dc.field(default_factory=lambda: ["en"])  # ISO 639-1 codes kept
    min_score: float = 0.65  # the top language's probability must reach this

    def validate(self) -> LanguageFilterConfig:
        if not self.languages:
            raise ConfigError("language_filter.languages is empty: list the codes to keep, e.g. [en]")
        check_fraction("language_filter", "min_score", self.min_score)
        return self


def identify(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability) of the most likely language."""
    return identify_batch([text])[0]


def identify_batch(texts: list[str]) -> list[tuple[str, float]]:
    """``identify`` of each text; the first ``MAX_CHARS`` characters decide."""
    return batch_identifier().classify([t[:MAX_CHARS] for t in texts])


def _identify_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    found = identify_batch(batch["text"])
    return {"language": [lang for lang, _ in found], "language_score": [s for _, s in found]}


def run_unit(ctx: Context, unit: int) -> dict[str, Any]:
    cfg: LanguageFilterConfig = ctx.config
    docs = read_documents(ctx.docs_dir / shard_file(unit))
    docs = map_documents(docs, _identify_batch, {"language": pa.string(), "language_score": pa.float64()})
    reasons = [
        f"language:{lang}"
        if lang not in cfg.languages
        else ("language_score" if score < cfg.min_score else None)
        for lang, score in zip(docs["language"], docs["language_score"])
    ]
    return write_split(ctx, unit, docs, Verdicts(reasons))


class LanguageFilter(Stage):
    name = "language_filter"
    Config = LanguageFilterConfig

    def steps(self) -> list[Step]:
        return [self.step(run_unit, writes_documents=True)]
