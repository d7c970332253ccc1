"""The batch n-gram statistics of the Gopher repetition rules equal their definitions, per document.

The reference below is the definition written plainly (a Counter of word tuples, a set of seen
n-grams), as the per-document implementation computed it; documents from a tiny vocabulary with
planted repeated spans make every n repeat, tie and overlap.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import data_pipeline.filters.ngrams as ngrams


def top_fraction(words: list[str], n: int) -> float:
    """Characters of the most frequent n-gram (ties: the first seen) times its count, over all."""
    total = sum(map(len, words))
    if total == 0 or len(words) < n:
        return 0.0
    gram, count = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1)).most_common(1)[0]
    return sum(map(len, gram)) * count / total


def duplicated_fraction(words: list[str], n: int) -> float:
    """Characters of the words inside an n-gram seen before (each word once), over all."""
    total = sum(map(len, words))
    seen: set[tuple[str, ...]] = set()
    covered = [False] * len(words)
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        if gram in seen:
            covered[i : i + n] = [True] * n
        seen.add(gram)
    return sum(len(w) for w, c in zip(words, covered) if c) / total if total else 0.0


def documents(seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(int(rng.integers(1, 15))):
        vocab = [f"w{i}" * (1 + i % 3) for i in range(int(rng.integers(1, 25)))]
        words = [vocab[int(i)] for i in rng.integers(0, len(vocab), int(rng.integers(0, 80)))]
        if len(words) > 12 and rng.random() < 0.5:  # a repeated span
            at = int(rng.integers(len(words) - 10))
            words[at:at] = words[at : at + int(rng.integers(5, 11))]
        docs.append(words)
    return docs


@pytest.mark.parametrize("chunk_words", [1 << 20, 7, 1])
def test_fractions_equal_their_definitions(monkeypatch: pytest.MonkeyPatch, chunk_words: int) -> None:
    """Any chunking of the batch (a chunk smaller than a document holds that document alone)."""
    monkeypatch.setattr(ngrams, "CHUNK_WORDS", chunk_words)
    top, dup = [1, 2, 3, 4], [2, 5, 6, 7, 8, 9, 10]
    for seed in range(40):
        docs = documents(seed)
        vocab = {w: i for i, w in enumerate(sorted({w for d in docs for w in d}))}
        flat = [w for d in docs for w in d]
        tops, dups = ngrams.ngram_fractions(
            np.array([vocab[w] for w in flat], dtype=np.int64), np.array([len(w) for w in flat], dtype=np.int64),
            np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64), top, dup)
        for k, words in enumerate(docs):
            assert [tops[n][k] for n in top] == [top_fraction(words, n) for n in top], (seed, k)
            assert [dups[n][k] for n in dup] == [duplicated_fraction(words, n) for n in dup], (seed, k)
