"""Gopher repetition rules: repeated lines, paragraphs and word n-grams (datatrove's thresholds)."""

from __future__ import annotations

import re

from data_pipeline.config import GopherRepetitionConfig
from data_pipeline.filters.text_stats import duplicated_ngram_fraction, duplicates, top_ngram_fraction


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
