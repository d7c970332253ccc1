"""Synthetic corpora with planted near duplicates of known Jaccard similarity, for tests and benchmarks.

Why random words: word 5-grams of random text from a large vocabulary never repeat by chance, so a
variant's similarity to its original is exactly what the edits made it, and unrelated documents
share nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def shingle_set(words: list[str], n: int = 5) -> set[tuple[str, ...]]:
    """Word n-grams as data_pipeline.dedup.minhash shingles them (a shorter text is one shingle)."""
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: list[str], b: list[str], n: int = 5) -> float:
    sa, sb = shingle_set(a, n), shingle_set(b, n)
    return len(sa & sb) / len(sa | sb) if sa | sb else 0.0


@dataclass
class PlantedCorpus:
    texts: list[str]
    ids: list[str]
    pairs: list[tuple[int, int, float]]  # (original index, variant index, true Jaccard)


def _vocabulary(rng: np.random.Generator, size: int) -> np.ndarray:
    codes = rng.integers(ord("a"), ord("z") + 1, size=(size, 9), dtype=np.uint32)
    lengths = rng.integers(3, 10, size=size)
    codes[np.arange(9)[None, :] >= lengths[:, None]] = 0  # NUL-padded: shorter words
    return codes.view("<U9").ravel()


def _variant(
    words: list[str], target: float, rng: np.random.Generator, vocab: np.ndarray
) -> tuple[list[str], float]:
    """Replace words at random positions (a fixed order) until the Jaccard is closest to ``target``."""
    order = rng.permutation(len(words))
    fresh = rng.choice(vocab, size=len(words)).tolist()

    def edited(k: int) -> list[str]:
        out = list(words)
        for i in order[:k]:
            out[i] = fresh[i]
        return out

    lo, hi = 0, len(words)
    while lo < hi:  # the smallest k whose Jaccard falls to the target or below
        mid = (lo + hi) // 2
        if jaccard(words, edited(mid)) > target:
            lo = mid + 1
        else:
            hi = mid
    best = min({max(lo - 1, 0), lo}, key=lambda k: abs(jaccard(words, edited(k)) - target))
    out = edited(best)
    return out, jaccard(words, out)


def planted_corpus(
    num_originals: int, words_per_doc: int, targets: list[float], seed: int = 0, vocab_size: int = 50_000
) -> PlantedCorpus:
    """``num_originals`` random documents; original ``i`` gets one variant of Jaccard ~``targets[i % len]``
    (a target of ``None``-like 0 adds no variant). Variants follow all originals, in random order."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng, vocab_size)
    originals = [rng.choice(vocab, size=words_per_doc).tolist() for _ in range(num_originals)]
    texts = [" ".join(w) for w in originals]
    variants: list[tuple[int, list[str], float]] = []
    for i, words in enumerate(originals):
        target = targets[i % len(targets)]
        if target > 0:
            v, j = _variant(words, target, rng, vocab)
            variants.append((i, v, j))
    pairs = []
    for k in rng.permutation(len(variants)).tolist():
        i, v, j = variants[k]
        pairs.append((i, len(texts), j))
        texts.append(" ".join(v))
    return PlantedCorpus(texts, [f"doc-{i:06d}" for i in range(len(texts))], pairs)
