"""Data hygiene (issue 34, item 8): training never reads the held-out validation windows, and the
``decontaminate`` pipeline stage removes training documents that share a word 13-gram with the
evaluation sets (the project's bundled lm-eval tasks by default), counting and setting them aside.
Before, 128 of 128 ``dsl_kjv_next_sentence`` contexts and gold continuations and 64 of 64
``dsl_devil_perplexity`` documents appeared verbatim in the bundled training corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_contract.errors import ConfigError
from data_pipeline.config import load_config
from data_pipeline.runner import run
from data_pipeline.stages.decontaminate import DecontaminateConfig, contamination, ngram_index, words
from dsl_lit.data.datamodule import PretrainDataModule
from tests.conftest import ROOT, scratch_dir

TASKS = ROOT / "data" / "eval_tasks"


def squash(text: str) -> str:
    return " ".join(words(text))


def kept_texts(out: Path) -> list[str]:
    return [t for f in sorted((out / "kept").glob("*.parquet")) for t in pq.read_table(f, columns=["text"])["text"].to_pylist()]


@pytest.fixture(scope="module")
def decontaminated(request: pytest.FixtureRequest) -> Path:
    out = scratch_dir(request, "decontaminated") / "out"
    run(load_config({"input": {"path": str(ROOT / "data" / "corpus")}, "output_dir": str(out),
                     "stages": ["normalize", "decontaminate"]}))
    return out


def test_the_bundled_tasks_no_longer_appear_in_the_cleaned_corpus(decontaminated):
    """Checked independently of the stage's n-gram code: each benchmark text (the KJV contexts and
    gold continuations, the Devil's Dictionary entries) as a substring of the kept documents."""
    corpus = "\n".join(squash(t) for t in kept_texts(decontaminated))
    kjv = [json.loads(line) for line in (TASKS / "kjv_next_sentence.jsonl").read_text().splitlines()]
    devil = [json.loads(line) for line in (TASKS / "devil_perplexity.jsonl").read_text().splitlines()]
    shown = [r["context"] for r in kjv] + [r["choices"][r["label"]] for r in kjv] + [r["text"] for r in devil]
    long_enough = [squash(t) for t in shown if len(words(t)) >= 8]
    assert len(long_enough) >= 0.9 * len(shown)
    leaked = [t for t in long_enough if t in corpus]
    assert not leaked, leaked[:3]
    # the entries under 8 words (3 of 64: "RESTITUTOR, n. Benefactor; philanthropist.") were kept
    # whole as documents before: none is a document of the cleaned corpus now
    documents = {squash(t) for t in kept_texts(decontaminated)}
    short = [squash(r["text"]) for r in devil if len(words(r["text"])) < 8]
    assert len(short) == 3 and not [t for t in short if t in documents]
    stats = json.loads((decontaminated / "stats.json").read_text())["stages"]["decontaminate"]
    removed = stats["removed"]
    assert removed["contamination:dsl_kjv_next_sentence"] >= 128 and removed["contamination:dsl_devil_perplexity"] >= 64
    assert stats["docs_in"] - stats["docs_out"] == sum(removed.values())
    # set aside with their reasons, as every stage does
    aside = [r for f in (decontaminated / "removed").glob("*.parquet") for r in pq.read_table(f).to_pylist()]
    assert {r["reason"] for r in aside if r["stage"] == "decontaminate"} == set(removed)
    # the distractors of the multiple-choice task are not its answers: their chapters stay
    assert stats["docs_out"] > 0.85 * stats["docs_in"]


def whole_index(tmp_path: Path) -> dict:
    (tmp_path / "whole.jsonl").write_text('{"q": "RESTITUTOR, n. Benefactor; philanthropist."}\n'
                                          '{"q": "the quick brown fox jumps over the lazy dog near the quiet river bank"}\n')
    return ngram_index(DecontaminateConfig(eval_sets=[str(tmp_path / "whole.jsonl")]).validate())


def test_the_data_modules_fingerprint_follows_the_decontamination_rules():
    """A build decontaminated under older rules is rebuilt: the data module repeats the stage's rules."""
    from data_pipeline.stages.decontaminate import TEXT_FORM
    from dsl_lit.data.cache import DECONTAMINATION_RULES

    assert DECONTAMINATION_RULES == TEXT_FORM


def test_ngram_rules(tmp_path):
    evals = tmp_path / "eval.jsonl"
    sentence = "the quick brown fox jumps over the lazy dog near the quiet river bank today"  # 15 words
    short = "seven words are not enough to count"  # 7 words
    exact_short = "eight words here are enough to count whole"  # 8 words
    evals.write_text("\n".join(json.dumps({"q": t}) for t in (sentence, short, exact_short)) + "\n")
    index = ngram_index(DecontaminateConfig(eval_sets=[str(evals)]).validate())
    assert contamination("Intro. The QUICK brown fox, jumps over the lazy dog near the quiet river! Outro", index) == "eval"
    assert contamination("the quick brown fox jumps over the lazy dog near the quiet", index) is None  # 12 words
    assert contamination("say: eight words here are enough to count whole.", index) == "eval"
    # under min_words: only a document that is the text and nothing else
    assert contamination("Note: seven words are not enough to count", index) is None
    assert contamination("Seven words are NOT enough to count.", index) == "eval"
    assert contamination("RESTITUTOR, n.  Benefactor; philanthropist.", whole_index(tmp_path)) == "whole"
    assert contamination("A restitutor, n. benefactor; philanthropist of old", whole_index(tmp_path)) is None
    with pytest.raises(ConfigError, match=r"decontaminate.ngram=5 must lie in \[8, 50\]"):
        DecontaminateConfig(ngram=5).validate()
    with pytest.raises(ConfigError, match="does not exist"):
        DecontaminateConfig(eval_sets=[str(tmp_path / "nope.jsonl")]).validate()
    (tmp_path / "tiny.jsonl").write_text('{"q": "5 + 6"}\n')
    with pytest.raises(ConfigError, match="hold no text of 8 words or more"):
        ngram_index(DecontaminateConfig(eval_sets=[str(tmp_path / "tiny.jsonl")]))


def test_the_demo_and_the_default_pipeline_decontaminate():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"stages=\[[^\]]*language_filter,decontaminate,train_tokenizer", makefile)
    import yaml

    assert yaml.safe_load((ROOT / "conf" / "data_pipeline.yaml").read_text())["stages"][-1] == "decontaminate"


def test_training_never_reads_the_held_out_windows(tmp_path):
    module = PretrainDataModule({"corpus_dir": str(ROOT / "data" / "corpus"), "cache_dir": str(tmp_path / "cache"),
                                 "tokenizer_vocab_size": 1024, "seq_len": 64, "global_batch_size": 8,
                                 "micro_batch_size": 8, "val_windows": 64})
    module.prepare_data()
    module.setup("fit")
    held_out = set(range(module.train_windows, module.num_windows))
    assert len(held_out) == 64
    sampler = module.batch_sampler()
    steps = 3 * module.train_windows // 8  # three passes over the training windows
    seen = set()
    for _, batch in zip(range(steps), sampler):
        seen.update(batch)
    assert seen == set(range(module.train_windows))  # every training window, and nothing else
    validated = {i for batch in module.val_dataloader().batch_sampler for i in batch}
    assert validated == held_out
    # validation in larger batches than training (a sweep's one-sequence runs): the same windows, in order
    wide = PretrainDataModule({**vars(module.cfg), "global_batch_size": 1, "micro_batch_size": 1, "val_batch_size": 16})
    wide.setup("fit")
    batches = list(wide.val_dataloader().batch_sampler)
    assert [len(b) for b in batches] == [16] * 4 and [i for b in batches for i in b] == sorted(held_out)
    with pytest.raises(ConfigError, match="data.val_batch_size=3 must be a positive multiple of the data-parallel size 2"):
        wide.cfg.__class__(**{**vars(wide.cfg), "val_batch_size": 3}).validate(dp_size=2)


def test_lm_eval_task_yamls_as_written_in_the_wild(tmp_path):
    """``!function`` tags (never run), ``include:`` of a base YAML, a rendered ``{{choices}}`` list
    and an out-of-range gold index: read without error, the gold answer indexed, the rest not."""
    rows = [{"q": "which river runs under the old stone bridge near the mill every spring",
             "choices": ["the quiet river that floods the lower fields below the mill each year", "no"], "label": 0},
            {"q": "short", "choices": ["a", "b"], "label": 7}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "base.yaml").write_text("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: rows.jsonl\n"
                                        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\n")
    (tmp_path / "task.yaml").write_text("include: base.yaml\ntask: wild\ndoc_to_text: '{{q}}'\n"
                                        "process_docs: !function utils.process_docs\n")
    index = ngram_index(DecontaminateConfig(eval_sets=[str(tmp_path / "task.yaml")]).validate())
    assert contamination("it said: the quiet river that floods the lower fields below the mill each year.", index) == "task"
    assert contamination("which river runs under the old stone bridge near the mill every spring", index) == "task"
    assert contamination("no", index) is None
