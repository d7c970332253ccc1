"""Stage ``quality_filter``: Gopher quality, Gopher repetition, C4 and FineWeb, each switchable.

Why in this order: the cheap length and ratio rules reject most bad pages before the n-gram counts
run; C4 may rewrite the text (dropping boilerplate lines), and later rules judge the rewritten text.
A removed document's reason names the first rule it failed; stats.json counts every reason.
Why per batch: each rule set sees only the documents the earlier ones kept, and both Gopher rule
sets share one word split of the batch (:class:`Words`), their statistics vectorised over it.
"""

from __future__ import annotations

import dataclasses as dc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from data_pipeline.context import Context
from data_pipeline.document_step import Verdicts, map_documents, text_bytes, write_split
from data_pipeline.filters.c4 import C4Config, c4
from data_pipeline.filters.fineweb import FineWebConfig, fineweb
from data_pipeline.filters.gopher_quality import GopherQualityConfig, gopher_quality_batch
from data_pipeline.filters.gopher_repetition import GopherRepetitionConfig, gopher_repetition_batch
from data_pipeline.filters.words import Words
from data_pipeline.io.shards import read_documents, shard_file, table_of
from data_pipeline.stage import Stage, Step


@dataclass
class QualityFilterConfig:
    gopher_quality: GopherQualityConfig = dc.field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = dc.field(default_factory=GopherRepetitionConfig)
    c4: C4Config = dc.field(default_factory=C4Config)
    fineweb: FineWebConfig = dc.field(default_factory=FineWebConfig)


def _per_document(rule: Callable[[str, Any], tuple[str | None, str]]
                  ) -> Callable[[list[str], Any], tuple[list[str | None], list[str]]]:
    def judge_each(texts: list[str], settings: Any) -> tuple[list[str | None], list[str]]:
        judged = [rule(text, settings) for text in texts]
        return [r for r, _ in judged], [t for _, t in judged]

    return judge_each


# (section, batch function, whether it reads the batch's word split; those that do not may edit the text)
FILTERS: tuple[tuple[str, Callable[..., Any], bool], ...] = (
    ("gopher_quality", gopher_quality_batch, True),
    ("gopher_repetition", gopher_repetition_batch, True),
    ("c4", _per_document(c4), False),
    ("fineweb", _per_document(fineweb), False),
)


def judge_batch(texts: Sequence[str], cfg: QualityFilterConfig) -> list[tuple[str | None, str]]:
    """Per text: (reason of the first failed rule or None, the text as the filters left it)."""
    reasons: list[str | None] = [None] * len(texts)
    current = list(texts)  # as the rules so far left them
    alive = np.arange(len(texts))  # not removed yet
    words, words_of = None, alive  # the split of current[words_of], while no rule edited them
    for name, rule, uses_words in FILTERS:
        settings = getattr(cfg, name)
        if not settings.enabled or not alive.size:
            continue
        batch = [current[i] for i in alive]
        if not uses_words:
            found, edited = rule(batch, settings)
            for i, text in zip(alive, edited):
                current[i] = text
            words = None
        else:
            if words is None:
                words, words_of = Words.split(batch), alive
            elif words_of.size != alive.size:
                words, words_of = words.select(np.searchsorted(words_of, alive)), alive
            found = rule(batch, settings, words)
        for i, reason in zip(alive, found):
            reasons[i] = reason
        alive = alive[[reason is None for reason in found]]
    return list(zip(reasons, current))


def judge(text: str, cfg: QualityFilterConfig) -> tuple[str | None, str]:
    """(reason of the first failed rule or None, the text as the filters left it)."""
    return judge_batch([text], cfg)[0]


class _Judge:
    """Picklable batch function for ``datasets.map``."""

    def __init__(self, cfg: QualityFilterConfig) -> None:
        self.cfg = cfg

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        judged = judge_batch(batch["text"], self.cfg)
        return {"text": [t for _, t in judged], "_reason": [r for r, _ in judged]}


def run_unit(ctx: Context, unit: int) -> dict[str, Any]:
    docs = read_documents(ctx.docs_dir / shard_file(unit))
    bytes_in = text_bytes(table_of(docs))
    docs = map_documents(docs, _Judge(ctx.config), {"_reason": pa.string()})
    reasons = docs["_reason"]
    return write_split(ctx, unit, docs.remove_columns("_reason"), Verdicts(list(reasons)), bytes_in)


class QualityFilter(Stage):
    name = "quality_filter"
    Config = QualityFilterConfig

    def steps(self) -> list[Step]:
        return [self.step(run_unit, writes_documents=True)]
