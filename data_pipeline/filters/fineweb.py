"""FineWeb's extra quality rules (Penedo et al. 2024), with their published thresholds."""

from __future__ import annotations

from dataclasses import dataclass

from data_pipeline.filters.text_stats import TERMINAL_PUNCTUATION, duplicates


@dataclass
class FineWebConfig:
    enabled: bool = True
    line_punct_thr: float = 0.12  # removed when fewer lines end in punctuation
    line_punct_exclude_zero: bool = False
    short_line_thr: float = 0.67  # removed when more lines are short
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01  # removed when more characters are in duplicated lines
    new_line_ratio: float = 0.3  # removed when line breaks per word exceed this


def fineweb(text: str, cfg: FineWebConfig) -> tuple[str | None, str]:
    lines = list(filter(None, map(str.strip, text.split("\n"))))
    if not lines:
        return "fineweb:empty", text
    ratio = sum(ln.endswith(TERMINAL_PUNCTUATION) for ln in lines) / len(lines)
    if ratio <= cfg.line_punct_thr and not (ratio == 0 and cfg.line_punct_exclude_zero):
        return "fineweb:line_punct_ratio", text
    if sum(len(ln) <= cfg.short_line_length for ln in lines) / len(lines) >= cfg.short_line_thr:
        return "fineweb:short_line_ratio", text
    if duplicates(lines)[1] / max(len(text.replace("\n", "")), 1) > cfg.char_duplicates_ratio:
        return "fineweb:char_dup_ratio", text
    if text.count("\n") / max(len(text.split()), 1) > cfg.new_line_ratio:
        return "fineweb:list_ratio", text
    return None, text
