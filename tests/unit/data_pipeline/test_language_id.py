"""Batch language identification answers exactly as py3langid's own ``classify``, score bits included."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from py3langid.langid import MODEL_FILE, LanguageIdentifier

import data_pipeline.filters.language_id as language_id
from data_pipeline.stages.language_filter import MAX_CHARS, identify_batch
from tests.messy_documents import messy_documents

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Bible chapters and dictionary entries (every 4th), messy pages, many scripts, and blanks."""
    bundled = []
    for path in sorted((ROOT / "data" / "corpus").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            bundled += [json.loads(line)["text"] for line in f]
    multilingual = [json.loads(line)["text"] for line in (ROOT / "tests" / "data" / "multilingual.jsonl").open()]
    extra = ["", " ", "A", "ÉCOLE NORMALE SUPÉRIEURE", "e\u0301te\u0301", "x" * 30_000]
    return bundled[::4] + messy_documents(200) + multilingual + extra


@pytest.fixture(scope="module")
def reference() -> LanguageIdentifier:
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def test_classify_equals_py3langid(texts: list[str], reference: LanguageIdentifier) -> None:
    got = identify_batch(texts)
    want = [reference.classify(t[:MAX_CHARS]) for t in texts]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == [float(w[1]) for w in want]  # exactly: the stored language_score
    assert len({lang for lang, _ in got}) > 10


def test_a_lost_warm_up_falls_back_to_the_byte_by_byte_walk(
    texts: list[str], reference: LanguageIdentifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces whose warm-up is too short to reach their predecessor's state are detected and the
    document walked byte by byte: the answers stay exact."""
    walked: list[int] = []
    exact = language_id.BatchIdentifier._walk_exactly
    monkeypatch.setattr(language_id, "WARMUP", 1)
    monkeypatch.setattr(language_id.BatchIdentifier, "_walk_exactly",
                        lambda self, *args: walked.append(args[3]) or exact(self, *args))
    sample = texts[::7]
    got = language_id.BatchIdentifier().classify([t[:MAX_CHARS] for t in sample])
    assert walked and got == [(lang, float(p)) for lang, p in (reference.classify(t[:MAX_CHARS]) for t in sample)]
