"""A crawl-like corpus of any size: English-looking documents with planted exact and near duplicates.

Why from the bundled corpus's vocabulary: documents drawn word by word from its 20,000 words at
their frequencies have the stop words, word lengths and punctuation the quality and language
filters look at, so every stage does the work it would on real text; lengths follow a log-normal
around ~300 words, as web pages do. Unrelated documents share no 5-gram worth mentioning, so what
the dedup stages find is what was planted: ``exact_share`` verbatim copies and ``near_share``
variants (0.3-1.5% of the words replaced: 5-gram Jaccard ~0.86-0.97, above near_dedup's 0.8) of
documents shortly before them.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
_WORD = re.compile(r"[a-z']+")


@dataclass
class Vocabulary:
    words: np.ndarray  # object: the words, most frequent first
    probabilities: np.ndarray
    sentence_end: np.ndarray  # object: "word."
    paragraph_end: np.ndarray  # object: "word.\n"


def bundled_vocabulary() -> Vocabulary:
    counts: Counter[str] = Counter()
    for path in sorted(CORPUS.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                counts.update(_WORD.findall(json.loads(line)["text"].lower()))
    words, freq = zip(*counts.most_common())
    w = np.array(words, dtype=object)
    return Vocabulary(w, np.array(freq) / sum(freq), w + ".", w + ".\n")


class CrawlCorpus:
    """Documents ``0, 1, 2, ...`` in batches; the same seed gives the same corpus."""

    def __init__(
        self, seed: int = 0, exact_share: float = 0.05, near_share: float = 0.10, window: int = 20_000
    ) -> None:
        self.vocab = bundled_vocabulary()
        self.rng = np.random.default_rng(seed)
        self.exact_share, self.near_share = exact_share, near_share
        self.recent: list[str] = []  # earlier documents that copies and variants are made of
        self.window = window
        self.planted = {"exact": 0, "near": 0}

    def _fresh(self, count: int) -> list[str]:
        v, rng = self.vocab, self.rng
        lengths = np.clip(rng.lognormal(np.log(300), 0.5, count), 40, 3000).astype(np.int64)
        idx = rng.choice(v.words.size, size=int(lengths.sum()), p=v.probabilities)
        marks = rng.random(idx.size)
        words = np.where(
            marks < 1 / 90, v.paragraph_end[idx], np.where(marks < 1 / 15, v.sentence_end[idx], v.words[idx])
        )
        ends = np.cumsum(lengths) - 1
        words[ends] = v.sentence_end[idx[ends]]
        return [" ".join(doc) for doc in np.split(words, ends[:-1] + 1)]

    def _variant(self, text: str) -> str:
        words = text.split(" ")
        k = max(1, int(len(words) * self.rng.uniform(0.003, 0.015)))
        at = self.rng.choice(len(words), size=k, replace=False)
        for i, w in zip(at.tolist(), self.rng.choice(self.vocab.words, size=k).tolist()):
            words[i] = w
        return " ".join(words)

    def batch(self, count: int) -> list[str]:
        fresh = iter(self._fresh(count))
        kind = self.rng.random(count)
        out = []
        for u in kind.tolist():
            if self.recent and u < self.exact_share:
                out.append(self.recent[int(self.rng.integers(len(self.recent)))])
                self.planted["exact"] += 1
            elif self.recent and u < self.exact_share + self.near_share:
                out.append(self._variant(self.recent[int(self.rng.integers(len(self.recent)))]))
                self.planted["near"] += 1
            else:
                out.append(next(fresh))
                self.recent.append(out[-1])
        self.recent = self.recent[-self.window :]
        return out


def write_corpus(directory: Path, documents: int, per_file: int = 100_000, seed: int = 0) -> dict[str, int]:
    """``documents`` as ``part-NNNN.jsonl.gz`` files of ``per_file``; returns the planted counts."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = CrawlCorpus(seed)
    written = 0
    for part in range(0, documents, per_file):
        with gzip.open(directory / f"part-{part // per_file:04d}.jsonl.gz", "wt", compresslevel=1) as f:
            for start in range(part, min(part + per_file, documents), 10_000):
                texts = corpus.batch(min(10_000, part + per_file - start, documents - start))
                f.writelines(
                    json.dumps({"id": f"d{written + i}", "text": t}) + "\n" for i, t in enumerate(texts)
                )
                written += len(texts)
    return {"documents": written, **corpus.planted}
