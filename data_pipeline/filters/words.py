"""A batch of documents split into whitespace words once, for every word-level heuristic.

Why interned: the Gopher rules look at each word's length, punctuation, letters, case and
n-grams. Doing that per word in Python costs ~1 microsecond a word; here ``str.split`` cuts each
document (in C), every distinct word of the batch gets an id (dict lookups in C), the per-word
properties are computed once per distinct word (a batch of 1,000 web pages has ~300,000 words but
~15,000 distinct ones), and the rules aggregate them per document with numpy. The words and their
properties are exactly Python's (``str.split``, ``str.strip``, ``str.lower``, ``str.isalpha``), so
the verdicts equal a per-word loop's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Words:
    """Document ``d``'s words are ``vocab[ids[bounds[d]:bounds[d + 1]]]``, in order."""

    ids: np.ndarray  # int64 per word: its index in vocab
    bounds: np.ndarray  # int64, one more than documents: where each document's words start
    vocab: list[str]  # the distinct words, in order of first appearance

    @classmethod
    def split(cls, texts: Sequence[str]) -> Words:
        """``text.split()`` of every text."""
        per_doc = list(map(str.split, texts))
        counts = np.fromiter(map(len, per_doc), dtype=np.int64, count=len(per_doc))
        words = list(itertools.chain.from_iterable(per_doc))
        vocab = list(dict.fromkeys(words))
        index = dict(zip(vocab, itertools.count()))
        ids = np.fromiter(map(index.__getitem__, words), dtype=np.int64, count=len(words))
        return cls(ids, np.concatenate([[0], np.cumsum(counts)]), vocab)

    def per_word(self, prop: Callable[[str], Any], dtype: Any = np.int64) -> np.ndarray:
        """``prop(word)`` for every word, computed once per distinct word."""
        return np.fromiter(map(prop, self.vocab), dtype=dtype, count=len(self.vocab))[self.ids]

    def doc_sums(self, values: np.ndarray) -> np.ndarray:
        """Per document, the sum of ``values`` (one per word) over its words."""
        totals = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        return totals[self.bounds[1:]] - totals[self.bounds[:-1]]

    def select(self, docs: np.ndarray) -> Words:
        """The words of documents ``docs`` only (same vocabulary)."""
        starts, ends = self.bounds[docs], self.bounds[docs + 1]
        counts = ends - starts
        offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        positions = np.arange(int(counts.sum()), dtype=np.int64) + offsets
        return Words(self.ids[positions], np.concatenate([[0], np.cumsum(counts)]), self.vocab)

    def mapped(self, fn: Callable[[str], str]) -> Words:
        """The same words through ``fn`` (e.g. ``str.lower``), re-interned: equal results share an id."""
        mapped = list(map(fn, self.vocab))
        vocab = list(dict.fromkeys(mapped))
        index = dict(zip(vocab, itertools.count()))
        new_id = np.fromiter(map(index.__getitem__, mapped), dtype=np.int64, count=len(mapped))
        return Words(new_id[self.ids], self.bounds, vocab)
