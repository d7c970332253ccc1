"""MinHash signatures of word n-gram shingles, computed with numpy over whole batches of documents.

Why this shape: per-word Python hashing (datasketch's sha1, datatrove's spaCy tokenizer) dominates
the cost of MinHash. Here one C-level regex pass finds the words of a document, the words of a whole
batch become one fixed-width unicode array whose code points are hashed column by column, and the
shingle and permutation hashes are array arithmetic. uint64 products wrap modulo 2**64, which is
exactly the multiply-add-shift hash family: ``h(x) = (a * x + b) >> 32`` with odd ``a``.

Documents without a single word get no shingles and therefore no signature (``EMPTY``); callers keep
them out of LSH buckets, so empty documents never look like duplicates of each other.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Words: runs of word characters, except that every CJK ideograph, kana or Hangul syllable is a word
# of its own (those scripts do not separate words with spaces).
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
WORD_PATTERN = re.compile(rf"[^\W{_CJK}]+|[{_CJK}]")
MAX_WORD_CHARS = 32  # longer words are hashed on their first 32 characters
EMPTY = np.iinfo(np.uint32).max
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_CHUNK_CELLS = 1 << 22  # shingles x permutations per vectorised block: bounds memory (~32 MB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads the bits of polynomial hashes over all 64 bits (in place)."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def words(text: str) -> list[str]:
    """The lower-cased words of ``text``, as shingling sees them."""
    return WORD_PATTERN.findall(text.lower())


def _byte_classes() -> np.ndarray:
    """Class of a character by its UTF-8 lead byte: 0 separator, 1 word byte, 2 a one-character word."""
    lut = np.zeros(256, dtype=np.uint8)
    for c in "0123456789abcdefghijklmnopqrstuvwxyz_":
        lut[ord(c)] = 1
    lut[0xC3:0xE0] = 1  # U+00C0-U+07FF: Latin-1 letters, Latin extended, Greek, Cyrillic, Hebrew, Arabic
    lut[0xE0:0xE2] = 1  # U+0800-U+1FFF: Indic scripts, Thai, Georgian, Latin extended additional
    lut[0xE3:0xEE] = 2  # U+3000-U+DFFF: kana, CJK ideographs, Hangul syllables (U+3000-U+303F: see below)
    return lut  # 0xC2 (U+0080-U+00BF), 0xE2 (punctuation, symbols), 0xEE-0xFF, emoji: separators


_LEAD_CLASS = _byte_classes()
_POWERS = np.cumprod(np.full(4 * MAX_WORD_CHARS, 0x100000001B3, dtype=np.uint64))


def word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 hash of every word of every text, concatenated; int64 word count per text).

    Splits exactly as ``words()`` does on ASCII and CJK text, but on the UTF-8 bytes of the whole
    batch at once: a byte's class is that of its character's lead byte, a word starts where the class
    turns non-zero or at every one-character-word character, and a word's hash is a polynomial over
    its first ``4 * MAX_WORD_CHARS`` bytes summed with ``np.add.reduceat``.
    """
    encoded = [t.lower().encode("utf-8") for t in texts]
    data = np.frombuffer(b"\0".join(encoded), dtype=np.uint8)  # NUL (a separator) between texts
    if data.size == 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(len(texts), dtype=np.int64)
    positions = np.arange(data.size)
    is_lead = (data & 0xC0) != 0x80
    lead = np.maximum.accumulate(np.where(is_lead, positions, 0))
    cls = _LEAD_CLASS[data[lead]]
    second = data[np.minimum(lead + 1, data.size - 1)]
    cls[(data[lead] == 0xE3) & (second == 0x80)] = 0  # U+3000-U+303F: CJK spaces and punctuation
    prev = np.empty_like(cls)
    prev[0], prev[1:] = 0, cls[:-1]
    starts = (cls != 0) & ((prev == 0) | (is_lead & ((cls == 2) | (prev == 2))))
    start_pos = np.flatnonzero(starts)
    if start_pos.size == 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(len(texts), dtype=np.int64)
    in_word = np.flatnonzero(cls != 0)
    word_of_byte = np.cumsum(starts)[in_word] - 1
    offset = np.minimum(in_word - start_pos[word_of_byte], _POWERS.size - 1)
    terms = data[in_word].astype(np.uint64) * _POWERS[offset]
    terms[offset == _POWERS.size - 1] = 0  # bytes past the cap do not count
    h = np.add.reduceat(terms, np.searchsorted(in_word, start_pos))
    text_starts = np.cumsum([0] + [len(e) + 1 for e in encoded[:-1]])
    doc_of_word = np.searchsorted(text_starts, start_pos, side="right") - 1
    return mix64(h), np.bincount(doc_of_word, minlength=len(texts)).astype(np.int64)


def shingle_hashes(texts: Sequence[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 hash of every word ``ngram``-shingle, concatenated; shingle count per text).

    A text with fewer than ``ngram`` words (but at least one) is a single shingle of all its words.
    """
    h, counts = word_hashes(texts)
    n_words = h.size
    if n_words == 0:
        return h, np.zeros(len(texts), dtype=np.int64)
    doc = np.repeat(np.arange(len(texts)), counts)
    starts = np.cumsum(counts) - counts
    pos = np.arange(n_words) - starts[doc]  # position of each word within its document
    left = counts[doc] - pos  # words from here to the end of the document
    weights = np.random.default_rng(0x5EED).integers(1, 2**63, size=ngram, dtype=np.uint64) | np.uint64(1)
    shingle = h * weights[0]
    for k in range(1, ngram):
        shifted = np.zeros(n_words, dtype=np.uint64)
        shifted[:-k] = h[k:]
        shingle += np.where(left > k, shifted, np.uint64(0)) * weights[k]
    is_start = (left >= ngram) | ((pos == 0) & (counts[doc] < ngram))
    shingle = mix64(shingle[is_start])
    return shingle, np.bincount(doc[is_start], minlength=len(texts)).astype(np.int64)


_PROBES = 64  # densification attempts before the sequential fallback


@dataclass(frozen=True)
class MinHasher:
    """``num_perm`` MinHash values per document, drawn from ``seed``: the same seed, the same signatures.

    ``scheme="oph"`` (default) is one-permutation hashing with optimal densification (Li et al. 2012,
    Shrivastava 2017): each shingle is hashed once into one of ``num_perm`` bins and a bin keeps its
    minimum; empty bins copy the value of the first non-empty bin along a fixed probe sequence, so the
    estimate stays unbiased. It costs O(shingles) instead of O(shingles x num_perm).
    ``scheme="classic"`` is textbook MinHash with ``num_perm`` multiply-add-shift hashes, for reference.
    """

    num_perm: int = 112
    ngram: int = 5
    seed: int = 1
    scheme: str = "oph"

    def __post_init__(self) -> None:
        if self.scheme not in ("oph", "classic"):
            raise ValueError(f"scheme must be 'oph' or 'classic', got {self.scheme!r}")
        rng = np.random.default_rng(self.seed)
        object.__setattr__(self, "_a", rng.integers(1, 2**63, size=self.num_perm, dtype=np.uint64) * 2 + 1)
        object.__setattr__(self, "_b", rng.integers(0, 2**63, size=self.num_perm, dtype=np.uint64))
        object.__setattr__(self, "_salt", rng.integers(0, 2**63, dtype=np.uint64))
        probes = rng.integers(0, self.num_perm, size=(self.num_perm, _PROBES))
        object.__setattr__(self, "_probes", probes)

    def signatures(self, texts: Sequence[str]) -> np.ndarray:
        """uint32 [len(texts), num_perm]; a text without words gets a row of ``EMPTY``."""
        shingles, counts = shingle_hashes(texts, self.ngram)
        return self.signatures_of_shingles(shingles, counts)

    def signatures_of_shingles(self, shingles: np.ndarray, counts: np.ndarray) -> np.ndarray:
        if self.scheme == "classic":
            return self._classic(shingles, counts)
        return self._one_permutation(shingles, counts)

    def _one_permutation(self, shingles: np.ndarray, counts: np.ndarray) -> np.ndarray:
        out = np.full((counts.size, self.num_perm), EMPTY, dtype=np.uint32)
        if shingles.size == 0:
            return out
        h = mix64(shingles ^ self._salt)
        bins = ((h >> np.uint64(32)) * np.uint64(self.num_perm)) >> np.uint64(32)
        cells = np.repeat(np.arange(counts.size, dtype=np.uint64), counts) * np.uint64(self.num_perm) + bins
        np.minimum.at(out.reshape(-1), cells.astype(np.int64), (h & np.uint64(0xFFFFFFFF)).astype(np.uint32))
        self._densify(out, counts > 0)
        return out

    def _densify(self, out: np.ndarray, has_shingles: np.ndarray) -> None:
        """Fill empty bins of non-empty documents from their probe sequence's first non-empty bin."""
        original = out.copy()
        rows, cols = np.nonzero((original == EMPTY) & has_shingles[:, None])
        for attempt in range(_PROBES):
            if rows.size == 0:
                return
            source = original[rows, self._probes[cols, attempt]]
            found = source != EMPTY
            out[rows[found], cols[found]] = source[found]
            rows, cols = rows[~found], cols[~found]
        for r, c in zip(rows.tolist(), cols.tolist()):  # rare: a document with very few shingles
            k = 1
            while original[r, (c + k) % self.num_perm] == EMPTY:
                k += 1
            out[r, c] = original[r, (c + k) % self.num_perm]

    def _classic(self, shingles: np.ndarray, counts: np.ndarray) -> np.ndarray:
        out = np.full((counts.size, self.num_perm), EMPTY, dtype=np.uint32)
        has = np.flatnonzero(counts)
        if has.size == 0:
            return out
        ends = np.cumsum(counts[has])
        starts = ends - counts[has]
        max_rows = max(1, _CHUNK_CELLS // self.num_perm)
        i = 0
        while i < has.size:  # blocks of whole documents, about max_rows shingles each
            j = max(int(np.searchsorted(ends, starts[i] + max_rows, side="right")), i + 1)
            values = shingles[starts[i] : ends[j - 1], None] * self._a
            values += self._b
            mins = np.minimum.reduceat(values, starts[i:j] - starts[i], axis=0)
            out[has[i:j]] = (mins >> np.uint64(32)).astype(np.uint32)
            i = j
        return out


def band_hashes(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 [n, bands]: one hash per band of ``rows`` consecutive signature values (LSH keys)."""
    n = signatures.shape[0]
    if bands * rows > signatures.shape[1]:
        raise ValueError(f"bands x rows = {bands * rows} exceeds num_perm = {signatures.shape[1]}")
    cols = signatures[:, : bands * rows].reshape(n, bands, rows).astype(np.uint64)
    h = np.full((n, bands), 0xCBF29CE484222325, dtype=np.uint64)
    for r in range(rows):
        h ^= cols[:, :, r]
        h *= np.uint64(0x100000001B3)
        h = mix64(h)
    h += np.arange(bands, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15)  # bands never collide
    return h & _MASK64


def jaccard_of_signatures(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """MinHash estimate of Jaccard similarity: the fraction of equal signature values (row-wise)."""
    return (np.asarray(a) == np.asarray(b)).mean(axis=-1)


def jaccard_of_shingle_sets(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two shingle hash arrays (duplicates ignored)."""
    a, b = np.unique(a), np.unique(b)
    union = np.union1d(a, b).size
    return np.intersect1d(a, b, assume_unique=True).size / union if union else 0.0
