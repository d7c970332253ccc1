"""Stage ``normalize``: Unicode normal form, control characters and whitespace, made uniform.

Why before dedup: two copies of a page that differ only in NFC vs NFD accents, CRLF vs LF or
trailing spaces are the same document; normalising first lets exact dedup see that.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from data_contract.errors import ConfigError
from data_pipeline.context import Context
from data_pipeline.document_step import Verdicts, map_documents, text_bytes, write_split
from data_pipeline.io.shards import read_documents, shard_file, table_of
from data_pipeline.stage import Stage, Step

_CONTROL = re.compile(
    r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\u202a-\u202e\u2060-\u2064\ufeff]"
)
_HSPACE_RUN = re.compile(r"[^\S\n]+")
_TRAILING = re.compile(r" +\n")


@dataclass
class NormalizeConfig:
    form: str = "NFC"  # Unicode normal form: NFC, NFKC, NFD, NFKD, or none
    strip_control: bool = True  # drop control and format characters except \t and \n
    unify_newlines: bool = True  # \r\n and \r -> \n
    collapse_spaces: bool = True  # runs of horizontal whitespace -> one space; trailing spaces cut
    max_newlines: int = 2  # longer runs of line breaks are cut to this many (0: keep all)
    strip: bool = True  # no leading or trailing whitespace

    def validate(self) -> NormalizeConfig:
        if self.form not in ("NFC", "NFKC", "NFD", "NFKD", "none"):
            raise ConfigError(f"normalize.form={self.form!r} must be one of NFC, NFKC, NFD, NFKD, none")
        if self.max_newlines < 0:
            raise ConfigError(
                f"normalize.max_newlines={self.max_newlines} must be >= 0 (0 keeps every line break)"
            )
        return self


def normalize_text(text: str, cfg: NormalizeConfig) -> str:
    if cfg.form != "none":
        text = unicodedata.normalize(cfg.form, text)
    if cfg.unify_newlines:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if cfg.strip_control:
        text = _CONTROL.sub("", text)
    if cfg.collapse_spaces:
        text = _TRAILING.sub("\n", _HSPACE_RUN.sub(" ", text))
    if cfg.max_newlines:
        text = re.sub(f"\n{{{cfg.max_newlines + 1},}}", "\n" * cfg.max_newlines, text)
    return text.strip() if cfg.strip else text


def run_unit(ctx: Context, unit: int) -> dict[str, Any]:
    cfg: NormalizeConfig = ctx.config
    docs = read_documents(ctx.docs_dir / shard_file(unit))
    bytes_in = text_bytes(table_of(docs))
    docs = map_documents(docs, lambda batch: {"text": [normalize_text(t, cfg) for t in batch["text"]]}, {})
    reasons = [None if t.strip() else "empty_after_normalize" for t in docs["text"]]
    return write_split(ctx, unit, docs, Verdicts(reasons), bytes_in)


class Normalize(Stage):
    name = "normalize"
    Config = NormalizeConfig

    def steps(self) -> list[Step]:
        return [self.step(run_unit, writes_documents=True)]
