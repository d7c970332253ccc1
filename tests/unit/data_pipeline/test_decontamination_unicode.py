"""Decontamination after Unicode normalisation, on every build path (issue 41, item 4).

Before: copies of a benchmark text disguised with soft hyphens (U+00AD), combining joiners (U+034F,
U+200D), fullwidth forms or Cyrillic look-alikes were kept by the ``decontaminate`` stage, and a
copy with zero-width spaces was kept by the data module's own build (which has no ``normalize``
stage). Now the evaluation texts and the training documents are compared in one canonical form
(NFKD, marks and default-ignorables dropped, confusables mapped, case folded) wherever the stage
runs; each disguised copy is removed and counted, an ordinary document kept."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_pipeline.config import load_config
from data_pipeline.runner import run
from data_pipeline.stages.decontaminate import (
    DecontaminateConfig,
    canonical,
    contamination,
    ngram_index,
    words,
)
from dsl_lit.data.datamodule import PretrainDataModule
from tests.conftest import ROOT

TASKS = ROOT / "data" / "eval_tasks"
SET = "dsl_devil_perplexity"
REASON = f"contamination:{SET}"
# Word-wise look-alikes: Cyrillic and Greek letters drawn like the Latin ones they replace.
CYRILLIC = str.maketrans("aceopxyiTHEABKMO", "асеорхуіТНЕАВКМО")
GREEK = str.maketrans("oiABEHIKMNOPTXYZ", "οιΑΒΕΗΙΚΜΝΟΡΤΧΥΖ")


def _every_letter(text: str, mark: str) -> str:
    """``mark`` after every letter of every word (inside words, where a reader never sees it)."""
    return "".join(c + mark if c.isalpha() else c for c in text)


def _fullwidth(text: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


DISGUISES = {
    "soft_hyphen": lambda t: _every_letter(t, "\u00ad"),
    "combining_grapheme_joiner": lambda t: _every_letter(t, "\u034f"),
    "zero_width_joiner": lambda t: _every_letter(t, "\u200d"),
    "zero_width_space": lambda t: _every_letter(t, "\u200b"),
    "fullwidth": _fullwidth,
    "cyrillic": lambda t: t.translate(CYRILLIC),
    "greek_capitals": lambda t: t.upper().translate(GREEK),
    "combining_marks": lambda t: _every_letter(t, "\u0336"),  # a strike-through drawn over each letter
    "variation_selectors_and_bom": lambda t: "\ufeff" + _every_letter(t, "\ufe0f"),
}
ORDINARY = [
    "The harbour master counted the boats twice before the storm and wrote the number in a blue book.",
    "Сегодня утром мы пошли на рынок и купили свежий хлеб, сыр и немного яблок для пирога.",  # real Russian
    "Οι μαθητές διάβασαν το βιβλίο στη βιβλιοθήκη και μετά έγραψαν μια σύντομη περίληψη.",  # real Greek
]


def _benchmark_text() -> str:
    entries = [json.loads(line)["text"] for line in (TASKS / "devil_perplexity.jsonl").read_text().splitlines()]
    return next(t for t in entries if len(words(t)) >= 30)


def _filler(n: int) -> list[str]:
    """Documents for the tokenizer to learn from that share nothing with the benchmarks."""
    vocab = ("river stone bright window copper garden lantern orchard meadow thunder quiet pebble violet "
             "harbor marble saddle kettle willow falcon ember canyon").split()
    return [" ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(60)) + "." for i in range(n)]


def _corpus(directory: Path, filler: int = 0) -> dict[str, str]:
    """One document per disguise, the ordinary ones and ``filler``: id -> text, written as JSONL."""
    text = _benchmark_text()
    docs = {f"disguised/{name}": disguise(text) for name, disguise in DISGUISES.items()}
    docs |= {f"ordinary/{i}": t for i, t in enumerate(ORDINARY)}
    docs |= {f"filler/{i}": t for i, t in enumerate(_filler(filler))}
    directory.mkdir(parents=True)
    (directory / "docs.jsonl").write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()),
                                          encoding="utf-8")
    return docs


def _set_aside(out: Path) -> dict[str, str]:
    rows = [r for f in (out / "removed").glob("*.parquet") for r in pq.read_table(f).to_pylist()]
    return {r["id"]: r["reason"] for r in rows if r["stage"] == "decontaminate"}


def _check(out: Path, docs: dict[str, str]) -> None:
    removed = _set_aside(out)
    disguised = {k for k in docs if k.startswith("disguised/")}
    assert {k: removed.get(k) for k in disguised} == dict.fromkeys(disguised, REASON)
    assert not {k for k in removed if not k.startswith("disguised/")}  # the ordinary documents stay
    stats = json.loads((out / "stats.json").read_text())["stages"]["decontaminate"]
    assert stats["removed"] == {REASON: len(DISGUISES)}
    assert stats["docs_in"] - stats["docs_out"] == len(DISGUISES)


def test_the_canonical_form():
    plain = "The quick brown fox jumps over the lazy dog"
    for name, disguise in DISGUISES.items():
        assert words(disguise(plain)) == words(plain), name
    assert canonical("Straße ﬁne Ｔest") == "strasse fine test"
    assert words("ПРИВЕТ мир") == words("привет мир") != words("hello world")  # real Russian stays Russian words
    assert canonical("plain ascii TEXT") == "plain ascii text"


def test_each_disguise_is_caught_by_the_index(tmp_path):
    text = _benchmark_text()
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"text": text}) + "\n")
    index = ngram_index(DecontaminateConfig(eval_sets=[str(evals)]).validate())
    for name, disguise in DISGUISES.items():
        assert contamination(disguise(text), index) == "eval", name
        # and the other way round: a disguised benchmark catches the plain copy
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"text": disguise(text)}) + "\n")
        disguised_index = ngram_index(DecontaminateConfig(eval_sets=[str(tmp_path / f"{name}.jsonl")]).validate())
        assert contamination(text, disguised_index) == name, name
    for ordinary in ORDINARY:
        assert contamination(ordinary, index) is None


@pytest.mark.parametrize("stages", [["decontaminate"], ["normalize", "decontaminate"]])
def test_the_pipeline_stage_removes_every_disguised_copy(tmp_path, stages):
    docs = _corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    run(load_config({"input": {"path": str(tmp_path / "corpus")}, "output_dir": str(out), "stages": stages}))
    _check(out, docs)


def test_the_data_modules_own_build_removes_every_disguised_copy(tmp_path):
    """The data module runs ``[decontaminate, train_tokenizer, tokenize_pack]``: no ``normalize``."""
    docs = _corpus(tmp_path / "corpus", filler=40)
    module = PretrainDataModule({"corpus_dir": str(tmp_path / "corpus"), "cache_dir": str(tmp_path / "cache"),
                                 "tokenizer_vocab_size": 300, "seq_len": 32, "global_batch_size": 2,
                                 "micro_batch_size": 2})
    module.prepare_data()
    out = module.shards_dir.parent
    assert json.loads((module.shards_dir / "meta.json").read_text())["stages"][0] == "decontaminate"
    _check(out, docs)
