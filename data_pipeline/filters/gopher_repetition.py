"""Gopher repetition rules: repeated lines, paragraphs and word n-grams (datatrove's thresholds)."""

from __future__ import annotations

import dataclasses as dc
import re
from dataclasses import dataclass

from data_pipeline.filters.text_stats import duplicated_ngram_fraction, duplicates, top_ngram_fraction


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
    total = max(len(text), 1)
    paragraphs = [p for p in re.split(r"\n{2,}", text.strip()) if p.strip()]
    lines = [ln for ln in re.split(r"\n+", text) if ln.strip()]
    checks = [("dup_para", paragraphs, cfg.dup_para_frac, cfg.dup_para_char_frac)]
    checks.append(("dup_line", lines, cfg.dup_line_frac, cfg.dup_line_char_frac))
    for name, elements, frac, char_frac in checks:
        count, chars = duplicates(elements)
        if elements and count / len(elements) > frac:
            return f"gopher_repetition:{name}_frac", text
        if chars / total > char_frac:
            return f"gopher_repetition:{name}_char_frac", text
    words = text.lower().split()
    for n, threshold in cfg.top_n_grams:
        if top_ngram_fraction(words, int(n)) > threshold:
            return f"gopher_repetition:top_{int(n)}_gram", text
    for n, threshold in cfg.dup_n_grams:
        if duplicated_ngram_fraction(words, int(n)) > threshold:
            return f"gopher_repetition:dup_{int(n)}_grams", text
    return None, text
