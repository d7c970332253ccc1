"""Counting helpers shared by the Gopher and FineWeb heuristics."""

from __future__ import annotations

from collections.abc import Sequence

TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？")


def duplicates(elements: Sequence[str]) -> tuple[int, int]:
    """(elements seen before, their characters): repeated lines or paragraphs, first copies excluded."""
    unique = set(elements)
    return len(elements) - len(unique), sum(map(len, elements)) - sum(map(len, unique))
