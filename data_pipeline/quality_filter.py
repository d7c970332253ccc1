"""Stage ``quality_filter``: Gopher quality, Gopher repetition, C4 and FineWeb, each switchable.

Why in this order: the cheap length and ratio rules reject most bad pages before the n-gram counts
run; C4 may rewrite the text (dropping boilerplate lines), and later rules judge the rewritten text.
A removed document's reason names the first rule it failed; stats.json counts every reason.
"""

from __future__ import annotations

import dataclasses as dc
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from data_pipeline.document_step import Verdicts, map_documents, text_bytes, write_split
from data_pipeline.filters.c4 import C4Config, c4
from data_pipeline.filters.fineweb import FineWebConfig, fineweb
from data_pipeline.filters.gopher_quality import GopherQualityConfig, gopher_quality
from data_pipeline.filters.gopher_repetition import GopherRepetitionConfig, gopher_repetition
from data_pipeline.shard_io import read_documents, shard_file, table_of
from data_pipeline.stage import Stage, Step


@dataclass
class QualityFilterConfig:
    gopher_quality: GopherQualityConfig = dc.field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = dc.field(default_factory=GopherRepetitionConfig)
    c4: C4Config = dc.field(default_factory=C4Config)
    fineweb: FineWebConfig = dc.field(default_factory=FineWebConfig)


FILTERS = (
    ("gopher_quality", gopher_quality),
    ("gopher_repetition", gopher_repetition),
    ("c4", c4),
    ("fineweb", fineweb),
)


def judge(text: str, cfg: QualityFilterConfig) -> tuple[str | None, str]:
    """(reason of the first failed rule or None, the text as the filters left it)."""
    for name, rule in FILTERS:
        settings = getattr(cfg, name)
        if settings.enabled:
            reason, text = rule(text, settings)
            if reason is not None:
                return reason, text
    return None, text


class _Judge:
    """Picklable batch function for ``datasets.map``."""

    def __init__(self, cfg: QualityFilterConfig) -> None:
        self.cfg = cfg

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        judged = [judge(t, self.cfg) for t in batch["text"]]
        return {"text": [t for _, t in judged], "_reason": [r for r, _ in judged]}


def run_unit(ctx: Any, unit: int) -> dict[str, Any]:
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
