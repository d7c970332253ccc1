"""Word n-gram repetition of many documents at once: Gopher's top and duplicated n-gram fractions.

Why no Counter of tuples: building a tuple per word per n costs ~3 microseconds a word over the
nine n of the default rules. Here the n-grams of a whole batch are grouped exactly (no hashing,
so no collisions) by sorting integer keys: an n-gram's group id is the pair (group of its first
n-1 words, its last word), and only positions whose (n-1)-gram occurs twice in a document can
start an n-gram that does, so each longer n sorts fewer positions (in web-like text, a few percent
from n = 3). Per document and n, with ``chars`` the characters of all its words:

- top: the most frequent n-gram (ties: the one that occurs first) times its count, in characters,
  over ``chars`` (0 for fewer than n words);
- duplicated: the characters of the words covered by an n-gram that occurred earlier in the
  document (each word counted once) over ``chars``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CHUNK_WORDS = 1 << 20  # keys below stay under 2**60: (group < 2**20) * 2**20 + word, times 2**20 positions


def ngram_fractions(
    words: np.ndarray, lengths: np.ndarray, bounds: np.ndarray, top: Sequence[int], dup: Sequence[int]
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """({n: top n-gram fraction per document}, {n: duplicated n-gram fraction per document}).

    ``words``: a word id per word (equal words, equal ids), ``lengths`` its characters, document
    ``d`` being ``bounds[d]:bounds[d + 1]``. Documents are processed in chunks of about
    ``CHUNK_WORDS`` words (a longer document alone).
    """
    num_docs = len(bounds) - 1
    tops = {n: np.zeros(num_docs) for n in top}
    dups = {n: np.zeros(num_docs) for n in dup}
    first = 0
    while first < num_docs:
        last = max(int(np.searchsorted(bounds, bounds[first] + CHUNK_WORDS, side="right")) - 1, first + 1)
        lo, hi = int(bounds[first]), int(bounds[last])
        chunk_top, chunk_dup = _chunk_fractions(words[lo:hi], lengths[lo:hi], bounds[first : last + 1] - lo,
                                                top, dup)
        for n, values in chunk_top.items():
            tops[n][first:last] = values
        for n, values in chunk_dup.items():
            dups[n][first:last] = values
        first = last
    return tops, dups


class _Groups:
    """Candidate n-gram positions (ascending) grouped by key: ``ids`` each candidate's group (groups
    numbered in key order, which is document order), and per group its ``counts`` and ``first``
    position; ``repeated``: the positions whose n-gram occurred before."""

    def __init__(self, keys: np.ndarray, positions: np.ndarray) -> None:
        size = max(keys.size, 1)
        if keys.size and int(keys.max()) >= np.iinfo(np.int64).max // size - 1:
            keys = np.unique(keys, return_inverse=True)[1].astype(np.int64)  # dense, order kept
        packed = np.sort(keys * size + np.arange(keys.size))  # by key, then position
        sorted_keys = packed // size
        index = packed - sorted_keys * size
        new = np.ones(keys.size, dtype=bool)
        new[1:] = sorted_keys[1:] != sorted_keys[:-1]
        starts = np.flatnonzero(new)
        self.counts = np.diff(np.append(starts, keys.size))
        self.first = positions[index[starts]]
        self.repeated = positions[index[~new]]
        self.ids = np.empty(keys.size, dtype=np.int64)
        self.ids[index] = np.cumsum(new) - 1


def _chunk_fractions(
    words: np.ndarray, lengths: np.ndarray, bounds: np.ndarray, top: Sequence[int], dup: Sequence[int]
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    size, num_docs = len(words), len(bounds) - 1
    doc_len = np.diff(bounds)
    doc = np.repeat(np.arange(num_docs, dtype=np.int64), doc_len)
    end = bounds[1:][doc]
    cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    chars = (cum[bounds[1:]] - cum[bounds[:-1]]).astype(np.float64)
    tops: dict[int, np.ndarray] = {}
    dups: dict[int, np.ndarray] = {}
    wanted = [int(n) for n in (*top, *dup) if int(n) >= 1]
    unigram = groups = None
    positions = np.arange(size, dtype=np.int64)
    for n in range(1, max(wanted, default=0) + 1):
        if n == 1:
            word_ids = words - (int(words.min()) if size else 0)
            groups = unigram = _Groups(doc * (int(word_ids.max(initial=0)) + 1) + word_ids, positions)
        else:
            assert groups is not None and unigram is not None
            keep = (groups.counts[groups.ids] >= 2) & (positions + n <= end[positions])
            positions = positions[keep]
            groups = _Groups(groups.ids[keep] * size + unigram.ids[positions + n - 1], positions)
        if n in top:
            tops[n] = _top_fraction(groups, n, bounds, doc_len, doc, cum, chars)
        if n in dup:
            dups[n] = _duplicated_fraction(groups, n, doc, cum, chars)
    return ({n: tops.get(int(n), np.zeros(num_docs)) for n in top},
            {n: dups.get(int(n), np.zeros(num_docs)) for n in dup})


def _top_fraction(groups: _Groups, n: int, bounds: np.ndarray, doc_len: np.ndarray, doc: np.ndarray,
                  cum: np.ndarray, chars: np.ndarray) -> np.ndarray:
    num_docs = len(bounds) - 1
    best = bounds[:-1].copy()  # without a repeated n-gram: the first one, once
    count = np.ones(num_docs, dtype=np.int64)
    group_doc = doc[groups.first]  # in document order
    if group_doc.size:
        seg = np.flatnonzero(np.diff(group_doc, prepend=-1))
        most = np.maximum.reduceat(groups.counts, seg)
        tied = groups.counts == np.repeat(most, np.diff(np.append(seg, group_doc.size)))
        earliest = np.minimum.reduceat(np.where(tied, groups.first, np.iinfo(np.int64).max), seg)
        docs = group_doc[seg]
        repeated = most >= 2
        best[docs[repeated]], count[docs[repeated]] = earliest[repeated], most[repeated]
    has = doc_len >= n
    out = np.zeros(num_docs)
    b = best[has]
    out[has] = ((cum[b + n] - cum[b]) * count[has]) / chars[has]
    return out


def _duplicated_fraction(groups: _Groups, n: int, doc: np.ndarray, cum: np.ndarray, chars: np.ndarray
                         ) -> np.ndarray:
    """Words covered by [i, i + n) for every repeated i: the runs of overlapping spans (all n long,
    so sorted by start they are sorted by end too), in characters."""
    out = np.zeros(chars.size)
    start = np.sort(groups.repeated)
    if start.size:
        new = np.ones(start.size, dtype=bool)
        new[1:] = start[1:] >= start[:-1] + n  # touching spans stay apart: they may be of two documents
        last = np.append(np.flatnonzero(new)[1:] - 1, start.size - 1)
        run_start, run_end = start[new], start[last] + n
        covered = np.bincount(doc[run_start], weights=cum[run_end] - cum[run_start], minlength=chars.size)
        out[chars > 0] = covered[chars > 0] / chars[chars > 0]
    return out
