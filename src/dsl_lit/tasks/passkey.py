"""Synthetic passkey retrieval (Mohtashami & Jaggi, 2023): a number hidden in repetitive filler,
asked for at the end. What a context-extension stage must buy is the ability to fetch it from
further back than the base model was trained to look.

One text format serves both sides, so a model is asked exactly what it was trained on:
- the training corpora (:func:`write_corpus`, shipped under ``data/passkey/``), documents of a
  given length range with the key at a uniformly random depth;
- the evaluation prompts (:func:`prompt_text`), padded with filler to a target length in tokens,
  with the key at a chosen depth (``dsl_lit.evaluation.passkey`` scores them).

Regenerate the shipped corpora with ``python -m dsl_lit.tasks.passkey``: the output is a function
of the seed only (``tests/unit/evaluation/test_passkey.py`` checks the shipped files against it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.", "The river runs to the sea.", "Birds sing in the morning.",
    "The road is long.",
)
"""Sentences the needle hides among: drawn at random, so the filler itself cannot be memorised
position by position, but cheap to predict once seen."""
KEY_WORDS = (
    "amber apple arrow basket bell berry blade bread brick bridge candle canyon castle cedar chain chalk "
    "cherry cloud clover comet copper coral cotton crown crystal daisy desert diamond dragon eagle ember "
    "falcon feather fern flame forest fountain garden garnet ginger glacier granite harbor hazel helmet "
    "hollow honey island ivory jacket jasmine jungle kettle lantern lemon lily linen lizard magnet maple "
    "marble meadow mirror moon needle nickel oak ocean olive orange orchid otter panther parrot pearl "
    "pepper pillow pine planet plum pocket prism quartz rabbit raven ribbon robin rocket saddle "
    "salmon silver slate spider spruce star stone storm sugar summit thunder tiger timber topaz tulip "
    "valley velvet violet walnut willow winter wizard wolf"
).split()
"""The key is KEY_LENGTH of these words (chance: 1 in 112). Not digits: copying a random number
needs the model to track its place within the number (digits recur), and retrieval itself appears
late in a tiny model (``experiment=cpu_context_128``: none by step 1,000, 73% by step 1,250), so a
CPU-sized run can afford only the simplest key."""
KEY_LENGTH = 1
QUESTION = " What is the pass key? Pass key:"
"""The answer follows a colon, which only the key sentence and the question contain: the copy
that retrieval needs is keyed on one token (as a word that the filler also uses would not be)."""


def key_sentence(key: str) -> str:
    return f" Pass key: {key}. Remember it. Pass key: {key}."


def random_key(rng: random.Random) -> str:
    return " ".join(rng.choice(KEY_WORDS) for _ in range(KEY_LENGTH))


def filler(rng: random.Random, n: int) -> str:
    return "".join(" " + rng.choice(FILLER) for _ in range(n))


def document(rng: random.Random, n_filler: int) -> str:
    """A training document: ``n_filler`` sentences with the key sentence at a random depth, then
    the question and its answer."""
    key, before = random_key(rng), rng.randint(0, n_filler)
    return (filler(rng, before) + key_sentence(key) + filler(rng, n_filler - before)
            + QUESTION + f" {key}.").lstrip()


def prompt_text(rng: random.Random, n_before: int, n_after: int, key: str) -> str:
    """An evaluation prompt (ends where the answer starts) with ``n_before`` filler sentences
    before the key sentence and ``n_after`` after it."""
    return (filler(rng, n_before) + key_sentence(key) + filler(rng, n_after) + QUESTION).lstrip()


def copy_document(rng: random.Random, n_words: int) -> str:
    """Random key words written twice: half of them can be predicted only by copying, where a
    passkey document rewards copying in a tenth of its tokens. Meant to teach a small model to copy
    (an induction head) sooner. Measured with ``experiment=cpu_context_128``: by step 1,250 the model
    retrieves 73% of passkeys but copies only 13% of these words, so the passkey documents carry most
    of what it learns."""
    words = " ".join(rng.choice(KEY_WORDS) for _ in range(n_words))
    return f"Words: {words}. Again: {words}."


@dataclass(frozen=True)
class PasskeyCorpus:
    """One shipped corpus: ``documents`` documents of ``min_filler``..``max_filler`` sentences, a
    ``copy_share`` of them copy documents (:func:`copy_document`) instead."""

    name: str
    documents: int
    min_filler: int
    max_filler: int
    seed: int
    copy_share: float = 0.0

    def texts(self) -> list[str]:
        rng = random.Random(self.seed)
        return [copy_document(rng, rng.randint(4, 16)) if rng.random() < self.copy_share
                else document(rng, rng.randint(self.min_filler, self.max_filler)) for _ in range(self.documents)]


SHIPPED_DIR = Path(__file__).resolve().parents[3] / "data" / "passkey"
CORPORA = {
    # ~6 filler tokens a sentence: 30-130 tokens, most documents within a 128-token window.
    "short": PasskeyCorpus("short", documents=24_000, min_filler=2, max_filler=16, seed=0, copy_share=0.5),
    # 512-token stage: keys up to ~500 tokens back.
    "medium": PasskeyCorpus("medium", documents=3_000, min_filler=16, max_filler=80, seed=1),
    # 2048-token stage: keys up to ~2000 tokens back.
    "long": PasskeyCorpus("long", documents=800, min_filler=64, max_filler=320, seed=2),
}


def write_corpus(corpus: PasskeyCorpus, directory: Path) -> Path:
    """``<directory>/<name>/passkey.jsonl.gz`` (records ``{"id", "text", "source"}``, as the bundled
    corpus); gzip's header carries no timestamp, so equal seeds give equal bytes."""
    path = directory / corpus.name / "passkey.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        for i, text in enumerate(corpus.texts()):
            record = {"id": f"passkey/{corpus.name}/{i}", "text": text, "source": "passkey"}
            out.write((json.dumps(record) + "\n").encode())
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR)
    args = parser.parse_args()
    for corpus in CORPORA.values():
        print(write_corpus(corpus, args.out))


if __name__ == "__main__":
    main()
