"""Gopher quality rules (Rae et al. 2021, MassiveText), with datatrove's default thresholds.

Why per batch: the word statistics come from one split of the batch (:class:`Words`), computed
once per distinct word and summed per document with numpy; the line statistics are looked at
only for the documents the word rules kept.
"""

from __future__ import annotations

import dataclasses as dc
import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data_pipeline.filters.words import Words

_PUNCT = "".join(sorted(set(string.punctuation) | {"“", "”", "‘", "’", "—", "–", "…"}))
_BULLETS = ("•", "-", "*", "‣", "◦")
_ELLIPSES = ("...", "…")


@dataclass
class GopherQualityConfig:
    enabled: bool = True
    min_doc_words: int = 50
    max_doc_words: int = 100_000
    min_avg_word_length: float = 3.0
    max_avg_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    max_non_alpha_words_ratio: float = 0.8  # "80% of words must contain an alphabetic character"
    min_stop_words: int = 2
    stop_words: list[str] = dc.field(
        default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"]
    )


def gopher_quality(text: str, cfg: GopherQualityConfig) -> tuple[str | None, str]:
    return gopher_quality_batch([text], cfg)[0], text


def _line_rule(text: str, cfg: GopherQualityConfig, words: int) -> str | None:
    """The rules on symbols and lines, in their order (``words`` > 0)."""
    if (text.count("#") + text.count("...") + text.count("…")) / words > cfg.max_symbol_word_ratio:
        return "max_symbol_word_ratio"
    lines = [ln for ln in text.split("\n") if ln.strip()] or [""]
    if sum(ln.lstrip().startswith(_BULLETS) for ln in lines) / len(lines) > cfg.max_bullet_lines_ratio:
        return "max_bullet_lines_ratio"
    if sum(ln.rstrip().endswith(_ELLIPSES) for ln in lines) / len(lines) > cfg.max_ellipsis_lines_ratio:
        return "max_ellipsis_lines_ratio"
    return None


def gopher_quality_batch(texts: Sequence[str], cfg: GopherQualityConfig, words: Words | None = None
                         ) -> list[str | None]:
    """The first failed rule of each text (None: kept). A word is a whitespace token stripped of
    punctuation, if anything is left; ``words``: the texts' split, when the caller has it."""
    words = Words.split(texts) if words is None else words
    stop = set(cfg.stop_words)

    def properties(word: str) -> tuple[int, bool, bool]:
        core = word.strip(_PUNCT)
        return len(core), any(map(str.isalpha, core)), bool(core) and core.lower() in stop

    props = list(map(properties, words.vocab))
    length, alpha, stop_word = (np.array([p[k] for p in props], dtype=np.int64)[words.ids] for k in range(3))
    count = words.doc_sums(length > 0)
    nonzero = np.maximum(count, 1)  # a text without words is judged as one of average length 0
    mean = words.doc_sums(length) / nonzero
    reasons: list[str | None] = [None] * len(texts)

    def fail(rule: str, failed: np.ndarray) -> None:  # rules are applied in their order: the first names it
        for i in np.flatnonzero(failed).tolist():
            reasons[i] = reasons[i] or rule

    fail("min_doc_words", count < cfg.min_doc_words)
    fail("max_doc_words", count > cfg.max_doc_words)
    fail("min_avg_word_length", mean < cfg.min_avg_word_length)
    fail("max_avg_word_length", mean > cfg.max_avg_word_length)
    for i, text in enumerate(texts):
        reasons[i] = reasons[i] or _line_rule(text, cfg, int(nonzero[i]))
    fail("max_non_alpha_words_ratio", words.doc_sums(alpha) / nonzero < cfg.max_non_alpha_words_ratio)
    fail("min_stop_words", words.doc_sums(stop_word) < cfg.min_stop_words)
    return [None if r is None else f"gopher_quality:{r}" for r in reasons]
