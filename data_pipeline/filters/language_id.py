"""py3langid's language identification for a batch of documents, its byte automaton stepped for many
pieces of text at once: the same answers and scores as ``LanguageIdentifier.classify``, bit for bit.

Why: py3langid walks a deterministic automaton over each document's UTF-8 bytes in a Python loop
(~150 ns a byte), collecting the byte n-gram feature of every state it enters. Its states stand
for the longest recent byte string (at most 6 bytes) that begins a feature, so after any
``WARMUP`` bytes the automaton is where it would be had it read everything before them. Each
document is therefore cut into ``SEGMENT``-byte pieces, each walked from the start state over the
``WARMUP`` bytes before it and then its own, all pieces of ~``GROUP_BYTES`` of documents in one
numpy step per byte position. The claim is checked, not trusted: a piece's state after its warm-up
must equal the state its predecessor reached at the same byte, and a document where it does not is
walked byte by byte instead. The features are then counted per document with one sort, in the
order py3langid's ``Counter`` holds them (first occurrence), because its naive Bayes score is a
float32 matrix product whose rounding depends on that order; the product, softmax and label
folding are py3langid's own expressions. Needs py3langid >= 0.4 (its compact automaton: one
feature per state, rows of transitions shared between states).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

SEGMENT = 128  # bytes of a piece
WARMUP = 8  # bytes read before a piece (py3langid's features are at most 6 bytes long)
GROUP_BYTES = 1 << 18  # documents walked and counted together: arrays that stay in cache


class BatchIdentifier:
    """py3langid's bundled model with probabilities normalised (``norm_probs=True``)."""

    def __init__(self) -> None:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        model = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        transitions = np.frombuffer(model.tk_nextmove, dtype=np.uint32)  # (row << 8) + byte -> state
        rows = np.asarray(model.tk_row, dtype=np.uint32) << 8
        self.next_row = rows[transitions]  # transition -> the row of the state it enters
        self.start_row = int(rows[0])
        self.feature_of = np.asarray(model.tk_output, dtype=np.int32)[transitions]  # -1: the state has none
        del transitions
        model.tk_nextmove = model._rowbase = None  # 40 MB less at the peak of loading
        self.log_probs = np.asarray(model.nb_ptc, dtype=np.float32)  # exactly the float16 values
        self.log_prior = model.nb_pc
        self.labels = list(model.nb_classes)
        first: dict[str, int] = {}
        self.aliases = [(first[c], i) for i, c in enumerate(self.labels) if first.setdefault(c, i) != i]

    @staticmethod
    def encode(text: str) -> bytes:
        """py3langid's input: an all-upper-case text lower-cased, NFC, UTF-8."""
        if text.isupper():
            text = text.lower()
        return unicodedata.normalize("NFC", text).encode("utf8", errors="surrogatepass")

    def classify(self, texts: Sequence[str]) -> list[tuple[str, float]]:
        """(label, probability) of each text: py3langid's ``classify``, bit for bit."""
        encoded = [self.encode(t) for t in texts]
        runs = []
        first = 0
        while first < len(encoded):
            last, size = first, 0
            while last < len(encoded) and (last == first or size + len(encoded[last]) <= GROUP_BYTES):
                size += len(encoded[last])
                last += 1
            runs.append(self._features(encoded[first:last]))
            first = last
        scores = np.zeros((len(encoded), len(self.labels)), dtype=np.float32)  # no features: all classes equal
        d = 0
        for features, counts, starts in runs:
            log_counts = np.log1p(counts)
            bounds = starts.tolist()
            for lo, hi in zip(bounds, bounds[1:]):
                if hi > lo:  # py3langid's product, per document: its float32 sum runs in this order
                    np.add(log_counts[lo:hi] @ self.log_probs[features[lo:hi]], self.log_prior, out=scores[d])
                d += 1
        # the rest is element-wise (or a row's max and sum), the same per row as for one row
        num_bytes = np.fromiter(map(len, encoded), dtype=np.float64, count=len(encoded))
        scores *= (1.0 / np.sqrt(np.maximum(num_bytes, 1.0))).astype(np.float32)[:, None]
        np.exp(scores - scores.max(axis=1, keepdims=True), out=scores)
        scores /= scores.sum(axis=1, keepdims=True)
        for i, j in self.aliases:
            scores[:, i] += scores[:, j]
            scores[:, j] = 0.0
        best = scores.argmax(axis=1)
        return [(self.labels[b], p) for b, p in zip(best.tolist(), scores[np.arange(len(encoded)), best].tolist())]

    def _features(self, encoded: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per document: its distinct features in order of first occurrence, their counts (float32,
        as py3langid's), and where each document's run begins."""
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        pieces = -(-lengths // SEGMENT)
        doc = np.repeat(np.arange(len(encoded)), pieces)
        index = np.arange(doc.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # within its document
        begin = starts[doc] + index * SEGMENT
        size = np.minimum(SEGMENT, starts[doc + 1] - begin)
        offsets = np.arange(-WARMUP, SEGMENT)[:, None]
        steps = np.empty((WARMUP + SEGMENT, doc.size), dtype=np.uint32)
        if data.size:
            steps[:] = data[np.clip(begin + offsets, 0, data.size - 1)]
        row = np.full(doc.size, self.start_row, dtype=np.uint32)
        fresh = index == 0  # a document's first piece starts from the start state, not a warm-up
        for t in range(WARMUP + SEGMENT):
            if t == WARMUP:
                warm = row.copy()
                row[fresh] = self.start_row
            np.add(row, steps[t], out=steps[t])
            self.next_row.take(steps[t], out=row)
        # a later piece must be where its predecessor (a whole piece) was after the same byte
        lost = np.flatnonzero(~fresh[1:] & (warm[1:] != row[:-1])) + 1
        for d in np.unique(doc[lost]).tolist():
            self._walk_exactly(steps, data, starts, d, np.flatnonzero(doc == d))
        owned = steps[WARMUP:]
        feature = self.feature_of[owned]
        feature[np.arange(SEGMENT)[:, None] >= size] = -1  # past a document's last piece
        return first_seen_counts(feature.ravel(), (begin + offsets[WARMUP:]).ravel(), doc, starts)

    def _walk_exactly(self, steps: np.ndarray, data: np.ndarray, starts: np.ndarray, d: int,
                      columns: np.ndarray) -> None:
        """Document ``d``'s transitions, one byte after another, into its pieces' columns."""
        row, walked = self.start_row, []
        for byte in data[starts[d] : starts[d + 1]].tolist():
            walked.append(row + byte)
            row = int(self.next_row[walked[-1]])
        for k, column in enumerate(columns.tolist()):
            part = walked[k * SEGMENT : (k + 1) * SEGMENT]
            steps[WARMUP : WARMUP + len(part), column] = part


def first_seen_counts(feature: np.ndarray, position: np.ndarray, piece_doc: np.ndarray, starts: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From the feature (-1: none) at every byte position of pieces (columns of the flattened
    (position, piece) layout), per document: its distinct features in order of first occurrence
    and their counts (float32), as ``collections.Counter`` holds them, and where each document's
    run begins. One sort of (document, feature, position) bit fields."""
    feature_bits = int(feature.max(initial=0)).bit_length() + 1
    position_bits = max(int(position.max(initial=0)).bit_length(), 1)
    none = (1 << feature_bits) - 1  # where -1 lands: dropped below
    doc = np.broadcast_to(piece_doc, (feature.size // max(piece_doc.size, 1), piece_doc.size)).ravel()
    packed = doc.astype(np.int64) << (feature_bits + position_bits)
    packed |= (feature.astype(np.int64) & none) << position_bits
    packed |= position
    packed.sort()
    key = packed >> position_bits
    new = np.ones(key.size, dtype=bool)
    new[1:] = key[1:] != key[:-1]
    group = np.flatnonzero(new)
    count = np.diff(np.append(group, key.size))
    real = (key[group] & none) != none
    first = packed[group[real]] & ((1 << position_bits) - 1)  # where each (document, feature) first occurs
    counts = np.zeros(int(starts[-1]), dtype=np.float32)
    counts[first] = count[real]
    feature_at = np.zeros(int(starts[-1]), dtype=np.int64)
    feature_at[first] = key[group[real]] & none
    at = np.flatnonzero(counts)  # first occurrences, by document and position
    return feature_at[at], counts[at], np.searchsorted(at, starts)


@lru_cache(maxsize=1)
def batch_identifier() -> BatchIdentifier:
    return BatchIdentifier()
