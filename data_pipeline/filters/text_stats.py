"""Counting helpers shared by the Gopher and FineWeb heuristics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？")


def duplicates(elements: Sequence[str]) -> tuple[int, int]:
    """(elements seen before, their characters): repeated lines or paragraphs, first copies excluded."""
    seen: set[str] = set()
    count = chars = 0
    for e in elements:
        if e in seen:
            count += 1
            chars += len(e)
        else:
            seen.add(e)
    return count, chars


def top_ngram_fraction(words: Sequence[str], n: int) -> float:
    """Characters of the most frequent word n-gram (times its count) over all word characters."""
    total = sum(len(w) for w in words)
    if total == 0 or len(words) < n:
        return 0.0
    ngrams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    gram, count = ngrams.most_common(1)[0]
    return sum(len(w) for w in gram) * count / total


def duplicated_ngram_fraction(words: Sequence[str], n: int) -> float:
    """Characters inside repeated word n-grams (each word counted once) over all word characters."""
    total = sum(len(w) for w in words)
    if total == 0 or len(words) < n:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    covered = [False] * len(words)
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        if gram in seen:
            covered[i : i + n] = [True] * n
        else:
            seen.add(gram)
    return sum(len(w) for w, c in zip(words, covered) if c) / total
