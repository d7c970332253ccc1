"""One cache dir, several data settings (issue 34, row 9): switching ``data.corpus_dir``,
``data.fim_rate`` or the tokenizer back and forth rebuilds only what was never built, runs with
different settings sharing the cache dir read their own shards, and a cache built before builds
existed is moved aside, not deleted. Before: the third switch raised "the data pipeline finished
but ... does not match the data config" and the user had to delete the cache by hand."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from data_contract.format import META_FILE, SHARDS_DIR, TOKENIZER_DIR
from dsl_lit.data.cache import BUILDS_DIR, build_dir, prepare_cache, settings_fingerprint, stale_reason
from dsl_lit.data.datamodule import PretrainDataModule
from tests.conftest import ROOT, scratch_dir

BUNDLED = ROOT / "data" / "corpus"


def part_of_bundled(path: Path, name: str, lines: int) -> Path:
    """A corpus of the first ``lines`` documents of one bundled file: what the cache's bookkeeping
    is tested on (the bundled corpus whole would only make each build take longer)."""
    path.mkdir()
    with gzip.open(BUNDLED / name, "rt") as src, gzip.open(path / "part.jsonl.gz", "wt") as dst:
        for i, line in enumerate(src):
            if i < lines:
                dst.write(line)
    return path


def other_corpus(path: Path) -> Path:
    return part_of_bundled(path, "devils_dictionary.jsonl.gz", 300)


@pytest.fixture(scope="module")
def corpus(request: pytest.FixtureRequest) -> Path:
    return part_of_bundled(scratch_dir(request, "corpus") / "kjv", "kjv_bible.jsonl.gz", 600)


def data_cfg(cache: Path, corpus: Path, **extra) -> dict:
    return {"corpus_dir": str(corpus), "cache_dir": str(cache), "tokenizer_vocab_size": 1024, "seq_len": 64,
            "global_batch_size": 2, "micro_batch_size": 2, **extra}


def corpus_of(shards: Path) -> str:
    return json.loads((shards / META_FILE).read_text())["corpus"]["fingerprint"]


def test_switching_settings_back_and_forth_on_one_cache(tmp_path, corpus):
    cache, other = tmp_path / "cache", other_corpus(tmp_path / "other")
    a, b, a_fim = data_cfg(cache, corpus), data_cfg(cache, other), data_cfg(cache, corpus, fim_rate=0.5)
    modules = {}
    for name, values in (("a", a), ("b", b), ("a again", a), ("a fim", a_fim), ("a last", a)):
        module = PretrainDataModule(values)
        module.prepare_data()
        assert stale_reason(module.cfg) is None, name  # the links point at this settings' build
        modules[name] = module
    builds = sorted(p.name for p in (cache / BUILDS_DIR).iterdir())
    assert len(builds) == 3  # a, b, a with FIM: returning to a settings rebuilt nothing
    assert modules["a"].shards_dir == modules["a last"].shards_dir != modules["b"].shards_dir
    assert (cache / SHARDS_DIR).is_symlink() and (cache / TOKENIZER_DIR).resolve() == modules["a last"].tokenizer_dir.resolve()
    # runs sharing the cache dir keep their own build whatever the links point at now
    assert corpus_of(modules["b"].shards_dir) != corpus_of(modules["a"].shards_dir)
    modules["b"].setup()
    assert modules["b"].tokens.meta["corpus"]["fingerprint"] == corpus_of(modules["b"].shards_dir)
    fresh_b = PretrainDataModule(b)  # a second process of run b (a rank) finds b's build without preparing
    assert fresh_b.shards_dir == modules["b"].shards_dir


def test_a_cache_built_before_builds_is_moved_aside_not_deleted(tmp_path, corpus):
    cache, other = tmp_path / "cache", other_corpus(tmp_path / "other")
    a = PretrainDataModule(data_cfg(cache, corpus))
    a.prepare_data()
    fingerprint = settings_fingerprint(a.cfg)
    for name in (TOKENIZER_DIR, SHARDS_DIR):  # the old layout: real directories in cache_dir
        (cache / name).unlink()
        shutil.move(cache / BUILDS_DIR / fingerprint / name, cache / name)
    shutil.rmtree(cache / BUILDS_DIR)
    assert build_dir(a.cfg) == cache and stale_reason(a.cfg) is None
    old_tokenizer = (cache / TOKENIZER_DIR / "tokenizer.json").read_bytes()
    b = PretrainDataModule(data_cfg(cache, other))
    b.prepare_data()
    legacy = [p for p in (cache / BUILDS_DIR).iterdir() if p.name.startswith("before-builds-")]
    assert len(legacy) == 1 and (legacy[0] / TOKENIZER_DIR / "tokenizer.json").read_bytes() == old_tokenizer
    assert corpus_of(cache / SHARDS_DIR) == corpus_of(b.shards_dir)


def test_prepare_cache_twice_is_a_no_op(tmp_path, corpus):
    cfg = PretrainDataModule(data_cfg(tmp_path / "cache", corpus)).cfg
    prepare_cache(cfg)
    meta = (build_dir(cfg) / SHARDS_DIR / META_FILE).stat().st_mtime_ns
    prepare_cache(cfg)
    assert (build_dir(cfg) / SHARDS_DIR / META_FILE).stat().st_mtime_ns == meta


def test_a_damaged_build_record_is_built_again_not_a_traceback(tmp_path, caplog, corpus):
    """Before: a cut-off meta.json in a cache (the build's record) was a JSON traceback at start-up."""
    import logging

    from dsl_lit.config.data import DataConfig
    from dsl_lit.data.packed import PackedTokens

    cfg = DataConfig(corpus_dir=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=1024)
    prepare_cache(cfg)
    meta = tmp_path / "cache" / TOKENIZER_DIR / META_FILE
    meta.write_text(meta.read_text()[: len(meta.read_text()) // 2])
    with caplog.at_level(logging.WARNING):
        assert stale_reason(cfg) is not None
    assert "is not a complete build record (cut off or damaged)" in caplog.text
    prepare_cache(cfg)
    assert stale_reason(cfg) is None and json.loads(meta.read_text())
    shards = tmp_path / "cache" / SHARDS_DIR
    (shards / META_FILE).write_text("{")
    with pytest.raises(ValueError, match=r"meta\.json is damaged .*build the data again"):
        PackedTokens(shards)
