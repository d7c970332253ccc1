"""Gopher repetition rules: repeated lines, paragraphs and word n-grams (datatrove's thresholds).

Why per batch: the n-gram rules of all the batch's documents that pass the line and paragraph
rules are computed together (:mod:`data_pipeline.filters.ngrams`) on the batch's one word split.
"""

from __future__ import annotations

import dataclasses as dc
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data_pipeline.filters.ngrams import ngram_fractions
from data_pipeline.filters.text_stats import duplicates
from data_pipeline.filters.words import Words

_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_LINE_BREAK = re.compile(r"\n+")


@dataclass
class GopherRepetitionConfig:
    enabled: bool = True
    dup_line_frac: float = 0.3
    dup_para_frac: float = 0.3
    dup_line_char_frac: float = 0.2
    dup_para_char_frac: float = 0.2
    top_n_grams: list[list[float]] = dc.field(default_factory=lambda: [[2, 0.2], [3, 0.18], [4, 0.16]])
    dup_n_grams: list[list[float]] = dc.field(
        default_factory=lambda: [[5, 0.15], [6, 0.14], [7, 0.13], [8, 0.12], [9, 0.11], [10, 0.10]]
    )


def gopher_repetition(text: str, cfg: GopherRepetitionConfig) -> tuple[str | None, str]:
    return gopher_repetition_batch([text], cfg)[0], text


def _repeated_blocks(text: str, cfg: GopherRepetitionConfig) -> str | None:
    """The paragraph and line rules, in their order."""
    total = max(len(text), 1)
    paragraphs = [p for p in _PARAGRAPH_BREAK.split(text.strip()) if p.strip()]
    lines = [ln for ln in _LINE_BREAK.split(text) if ln.strip()]
    checks = [("dup_para", paragraphs, cfg.dup_para_frac, cfg.dup_para_char_frac)]
    checks.append(("dup_line", lines, cfg.dup_line_frac, cfg.dup_line_char_frac))
    for name, elements, frac, char_frac in checks:
        count, chars = duplicates(elements)
        if elements and count / len(elements) > frac:
            return f"{name}_frac"
        if chars / total > char_frac:
            return f"{name}_char_frac"
    return None


def gopher_repetition_batch(texts: Sequence[str], cfg: GopherRepetitionConfig, words: Words | None = None
                            ) -> list[str | None]:
    """The first failed rule of each text (None: kept); n-grams are of lower-cased whitespace
    tokens. ``words``: the texts' split, when the caller has it."""
    reasons = [_repeated_blocks(text, cfg) for text in texts]
    pending = np.array([i for i, r in enumerate(reasons) if r is None], dtype=np.int64)
    top = [(int(n), threshold) for n, threshold in cfg.top_n_grams]
    dup = [(int(n), threshold) for n, threshold in cfg.dup_n_grams]
    if pending.size and (top or dup):
        # ``text.lower().split()`` is the lower-cased ``text.split()``: no character changes
        # between white space and not by lower-casing, and the final-sigma rule looks no further.
        lowered = (Words.split(texts) if words is None else words).select(pending).mapped(str.lower)
        tops, dups = ngram_fractions(lowered.ids, lowered.per_word(len), lowered.bounds,
                                     [n for n, _ in top], [n for n, _ in dup])
        rules = [(f"top_{n}_gram", tops[n] > t) for n, t in top]
        rules += [(f"dup_{n}_grams", dups[n] > t) for n, t in dup]
        for rule, failed in rules:
            for k in np.flatnonzero(failed):
                if reasons[pending[k]] is None:
                    reasons[pending[k]] = rule
    return [None if r is None else f"gopher_repetition:{r}" for r in reasons]
