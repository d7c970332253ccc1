"""C4's line filters (Raffel et al. 2020): drop boilerplate lines, reject pages that stay too short."""

from __future__ import annotations

import re
from dataclasses import dataclass

_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_POLICY = re.compile("terms of use|privacy policy|cookie policy|uses cookies|use of cookies|use cookies")
_END = (".", "!", "?", '"', "'")
_SENTENCE_END = re.compile(r"[.!?]+(?:\s|$)")


@dataclass
class C4Config:
    enabled: bool = True
    split_paragraph: bool = True  # lines are \n-separated (False: sentences)
    remove_citations: bool = True  # "[1]", "[citation needed]"
    filter_no_terminal_punct: bool = True  # drop lines not ending in . ! ? " or '
    min_num_sentences: int = 5  # documents with fewer are removed (-1: off)
    min_words_per_line: int = 3  # shorter lines are dropped (-1: off)
    max_word_length: int = 1000  # lines with a longer word are dropped (-1: off)
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True


def c4(text: str, cfg: C4Config) -> tuple[str | None, str]:
    lines = text.split("\n") if cfg.split_paragraph else [s for s in re.split(r"(?<=[.!?])\s+", text)]
    kept: list[str] = []
    for line in lines:
        if cfg.remove_citations:
            line = _CITATION.sub("", line)
        line = line.strip()
        lower = line.lower()
        if cfg.filter_lorem_ipsum and "lorem ipsum" in lower:
            return "c4:lorem_ipsum", text
        if cfg.filter_curly_bracket and "{" in line:
            return "c4:curly_bracket", text
        words = line.split()
        if cfg.filter_no_terminal_punct and (not line.endswith(_END) or line.endswith("...")):
            continue
        if cfg.min_words_per_line >= 0 and len(words) < cfg.min_words_per_line:
            continue
        if 0 <= cfg.max_word_length < len(line) and max(map(len, words)) > cfg.max_word_length:
            continue
        if cfg.filter_javascript and "javascript" in lower:
            continue
        if cfg.filter_policy and _POLICY.search(lower):
            continue
        kept.append(line)
    result = "\n".join(kept)
    if not result:
        return "c4:no_lines_left", text
    if cfg.min_num_sentences >= 0 and len(_SENTENCE_END.findall(result)) < cfg.min_num_sentences:
        return "c4:min_num_sentences", text
    return None, result
