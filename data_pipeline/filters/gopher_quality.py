"""Gopher quality rules (Rae et al. 2021, MassiveText), with datatrove's default thresholds."""

from __future__ import annotations

import dataclasses as dc
import string
from dataclasses import dataclass

_PUNCT = set(string.punctuation) | {"“", "”", "‘", "’", "—", "–", "…"}


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
    words = [w for w in (t.strip("".join(_PUNCT)) for t in text.split()) if w]
    n = len(words)
    rule = None
    if n < cfg.min_doc_words:
        rule = "min_doc_words"
    elif n > cfg.max_doc_words:
        rule = "max_doc_words"
    else:
        mean = sum(map(len, words)) / n
        lines = [ln for ln in text.split("\n") if ln.strip()] or [""]
        symbols = text.count("#") + text.count("...") + text.count("…")
        if mean < cfg.min_avg_word_length:
            rule = "min_avg_word_length"
        elif mean > cfg.max_avg_word_length:
            rule = "max_avg_word_length"
        elif symbols / n > cfg.max_symbol_word_ratio:
            rule = "max_symbol_word_ratio"
        elif (
            sum(ln.lstrip().startswith(("•", "-", "*", "‣", "◦")) for ln in lines) / len(lines)
            > cfg.max_bullet_lines_ratio
        ):
            rule = "max_bullet_lines_ratio"
        elif (
            sum(ln.rstrip().endswith(("...", "…")) for ln in lines) / len(lines)
            > cfg.max_ellipsis_lines_ratio
        ):
            rule = "max_ellipsis_lines_ratio"
        elif sum(any(c.isalpha() for c in w) for w in words) / n < cfg.max_non_alpha_words_ratio:
            rule = "max_non_alpha_words_ratio"
        elif sum(w.lower() in set(cfg.stop_words) for w in words) < cfg.min_stop_words:
            rule = "min_stop_words"
    return (None if rule is None else f"gopher_quality:{rule}"), text
