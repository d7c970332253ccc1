"""FineWeb's extra quality rules (Penedo et al. 2024), with their published thresholds."""

from __future__ import annotations

from data_pipeline.config import FineWebConfig
from data_pipeline.filters.text_stats import TERMINAL_PUNCTUATION, duplicates


def fineweb(text: str, cfg: FineWebConfig) -> tuple[str | None, str]:
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
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
