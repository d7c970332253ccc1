"""The bundled evaluation tasks' data, derived from what the project already redistributes: the
public-domain corpus (``data/corpus``) and the generated arithmetic task.

Why bundled: lm-eval's own tasks download their datasets from the Hugging Face hub, and nothing
here may download at run time. The JSONL files under ``data/eval_tasks`` are committed; this
module is how they were made (``python -m dsl_lit.evaluation.bundled`` rewrites them, byte for
byte the same: every choice is drawn from a seeded generator), and tests check it still is.

- ``dsl_kjv_next_sentence`` (multiple choice, loglikelihood): a sentence of a KJV chapter, then
  its true successor among three sentences of similar length from other chapters.
- ``dsl_devil_perplexity`` (loglikelihood_rolling): word/byte perplexity and bits per byte of
  Devil's Dictionary entries.
- ``dsl_arithmetic`` (generate_until): "What is a op b?" on the arithmetic task's held-out
  problems, few-shot from its training problems; exact match of the first number generated.

The corpus is what the bundled pretraining runs train on, so these measure fit to it (and, for
the arithmetic task, what post-training taught), not generalisation to unseen text.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsl_lit.config.posttrain import TaskConfig
from dsl_lit.config.resolvers import PROJECT_ROOT
from dsl_lit.tasks import arithmetic

CORPUS_DIR = PROJECT_ROOT / "data" / "corpus"
BUNDLED_TASKS_DIR = PROJECT_ROOT / "data" / "eval_tasks"
BUNDLED_TASKS = ("dsl_kjv_next_sentence", "dsl_devil_perplexity", "dsl_arithmetic")

_SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z])")
SENTENCE_CHARS = (40, 200)
"""Sentences this long (characters) are used: long enough to carry meaning, short enough to be cheap."""


def read_corpus(name: str, corpus_dir: Path = CORPUS_DIR) -> Iterator[dict[str, Any]]:
    with gzip.open(corpus_dir / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def chapter_sentences(text: str) -> list[str]:
    """The sentences of a KJV chapter record (its first line is the chapter title)."""
    body = text.split("\n", 1)[1] if "\n" in text else text
    return [s.strip() for s in _SENTENCE_END.split(body) if s.strip()]


def _usable(sentence: str) -> bool:
    return SENTENCE_CHARS[0] <= len(sentence) <= SENTENCE_CHARS[1]


def kjv_next_sentence(num_docs: int = 128, num_choices: int = 4, seed: int = 0,
                      corpus_dir: Path = CORPUS_DIR) -> list[dict[str, Any]]:
    """``{"context", "choices", "label"}`` documents: distractors are sentences of other chapters
    within 0.7x-1.4x of the true sentence's length, so length alone does not give it away."""
    rng = random.Random(seed)
    chapters = [chapter_sentences(r["text"]) for r in read_corpus("kjv_bible", corpus_dir)]
    pool = [(c, s) for c, sentences in enumerate(chapters) for s in sentences if _usable(s)]
    docs: list[dict[str, Any]] = []
    for c in rng.sample(range(len(chapters)), len(chapters)):
        pairs = [i for i in range(len(chapters[c]) - 1) if _usable(chapters[c][i]) and _usable(chapters[c][i + 1])]
        if not pairs:
            continue
        i = rng.choice(pairs)
        context, answer = chapters[c][i], chapters[c][i + 1]
        similar = [s for other, s in pool if other != c and 0.7 * len(answer) <= len(s) <= 1.4 * len(answer)]
        choices = [answer, *rng.sample(similar, num_choices - 1)]
        rng.shuffle(choices)
        docs.append({"context": context, "choices": choices, "label": choices.index(answer)})
        if len(docs) == num_docs:
            break
    return docs


def devil_entries(num_docs: int = 64, max_chars: int = 600, corpus_dir: Path = CORPUS_DIR) -> list[dict[str, Any]]:
    """``{"id", "text"}`` of evenly spaced Devil's Dictionary entries of at most ``max_chars``."""
    entries = [r for r in read_corpus("devils_dictionary", corpus_dir) if len(r["text"]) <= max_chars]
    stride = max(1, len(entries) // num_docs)
    return [{"id": r["id"], "text": r["text"]} for r in entries[::stride][:num_docs]]


def arithmetic_docs(num_fewshot_pool: int = 32) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(few-shot pool from the training problems, the held-out problems), the default ``task`` group's."""
    train, held_out = arithmetic.split(TaskConfig().validate())
    keep = lambda problem: {"question": problem["question"], "answer": problem["answer"]}  # noqa: E731
    return [keep(p) for p in train[:num_fewshot_pool]], [keep(p) for p in held_out]


def bundled_files(corpus_dir: Path = CORPUS_DIR) -> dict[str, list[dict[str, Any]]]:
    """Relative file name -> records of every bundled task's data."""
    fewshot, held_out = arithmetic_docs()
    return {
        "kjv_next_sentence.jsonl": kjv_next_sentence(corpus_dir=corpus_dir),
        "devil_perplexity.jsonl": devil_entries(corpus_dir=corpus_dir),
        "arithmetic_fewshot.jsonl": fewshot,
        "arithmetic_test.jsonl": held_out,
    }


def to_jsonl(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def write_bundled(out_dir: Path = BUNDLED_TASKS_DIR, corpus_dir: Path = CORPUS_DIR) -> list[Path]:
    paths = []
    for name, records in bundled_files(corpus_dir).items():
        path = out_dir / name
        path.write_text(to_jsonl(records), encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_bundled():
        print(written)
