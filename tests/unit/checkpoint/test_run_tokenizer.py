"""A run records the tokenizer it trained with (issue 41, the high-severity row and item 4): one
data cache dir rebuilt for a second corpus moves ``<cache_dir>/tokenizer`` to the new build, and a
checkpoint recorded only ``data.cache_dir``, so evaluating an earlier run (5.73 bits/byte instead
of 3.92), ``export_hf.py`` (the wrong ``tokenizer.json``) and ``sft.py init_from=`` silently used the
wrong tokenizer. Now the run dir and every checkpoint carry a copy and its hash, the readers use it,
and a tokenizer given to them with another hash is refused in one line; a checkpoint written before
keeps the old lookup, with a warning."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from data_contract.errors import ConfigError
from data_contract.format import file_sha256
from dsl_lit.checkpoint.directory import DirectoryCheckpointIO
from dsl_lit.checkpoint.files import checkpoint_problem
from dsl_lit.checkpoint.integrity import checksum_problem
from dsl_lit.checkpoint.tokenizer import (
    RECORD_FILE,
    checkpoint_tokenizer,
    copy_tokenizer,
    recorded_tokenizer,
    tokenizer_sha256,
)
from dsl_lit.config import CheckpointConfig
from dsl_lit.training.pretrained import StartingWeights
from dsl_lit.training.run_tokenizer import record_run_tokenizer, starting_tokenizer
from tests.conftest import ROOT
from tests.forked_python import run_python


def fake_tokenizer(path: Path, text: str) -> Path:
    """A tokenizer directory as far as recording goes (its files' bytes): ``text`` is its tokenizer.json."""
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text(text)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (path / "meta.json").write_text(json.dumps({"vocab_size": 4, "padded_vocab_size": 128, "eos_id": 1}))
    return path


def save_step(run: Path, step: int = 1) -> Path:
    """A checkpoint written by the real checkpoint IO into ``run/checkpoints/step-<step>``."""
    path = run / "checkpoints" / f"step-{step}"
    path.parent.mkdir(parents=True, exist_ok=True)
    DirectoryCheckpointIO({"data": {"cache_dir": str(run / "cache")}}).save_checkpoint(
        {"state_dict": {"w": torch.ones(2)}, "global_step": step}, path)
    return path


def record_run(run: Path, tokenizer: Path) -> None:
    """What ``record_run_tokenizer`` leaves in a run dir: the copy and its record."""
    copy_tokenizer(tokenizer, run / "tokenizer", {"sha256": tokenizer_sha256(tokenizer), "source": str(tokenizer)})


def test_every_checkpoint_carries_the_runs_tokenizer_and_its_hash(tmp_path):
    a = fake_tokenizer(tmp_path / "a", "tokenizer A")
    run = tmp_path / "run"
    record_run(run, a)
    step = save_step(run)
    assert checkpoint_problem(step) is None and checksum_problem(step) is None  # the copy is under the checksums
    meta = json.loads((step / "meta.json").read_text())
    assert meta["tokenizer"] == {"sha256": file_sha256(a / "tokenizer.json"), "source": str(a)}
    assert "tokenizer/tokenizer.json" in meta["files"] and "tokenizer/tokenizer.json" in meta["checksums"]
    assert (step / "tokenizer" / "tokenizer_config.json").read_bytes() == (a / "tokenizer_config.json").read_bytes()
    assert json.loads((step / "tokenizer" / RECORD_FILE).read_text()) == meta["tokenizer"]
    assert recorded_tokenizer(step).directory == step / "tokenizer"
    # a run that recorded none (a test, a recipe that does not): the checkpoint is as before
    bare = save_step(tmp_path / "bare")
    assert sorted(p.name for p in bare.iterdir()) == ["config.yaml", "meta.json", "shards", "trainer_state.pt"]
    assert "tokenizer" not in json.loads((bare / "meta.json").read_text()) and recorded_tokenizer(bare) is None


def test_readers_use_the_recorded_copy_and_refuse_another_tokenizer_in_one_line(tmp_path):
    a, b = fake_tokenizer(tmp_path / "a", "tokenizer A"), fake_tokenizer(tmp_path / "b", "tokenizer B")
    run = tmp_path / "run"
    record_run(run, a)
    step = save_step(run)
    shutil.rmtree(a)  # the source is gone (a data cache rebuilt for another corpus): the copies stand in
    assert checkpoint_tokenizer(step) == step / "tokenizer"
    same = fake_tokenizer(tmp_path / "a_elsewhere", "tokenizer A")
    assert checkpoint_tokenizer(step, same) == same  # the same tokenizer.json elsewhere is accepted
    with pytest.raises(ConfigError) as refused:
        checkpoint_tokenizer(step, b)
    message = str(refused.value)
    assert "\n" not in message and f"tokenizer_dir={b}" in message
    assert file_sha256(b / "tokenizer.json")[:12] in message and tokenizer_sha256(same)[:12] in message
    shutil.rmtree(step / "tokenizer")  # the step's copy lost: the run dir's
    assert checkpoint_tokenizer(step) == run / "tokenizer"
    (run / "tokenizer" / "tokenizer.json").write_text("edited")  # ... altered too: an error, not a guess
    with pytest.raises(ConfigError, match="are gone or altered; pass tokenizer_dir="):
        checkpoint_tokenizer(step)


def test_a_checkpoint_written_before_keeps_the_old_lookup_with_a_warning(tmp_path, caplog):
    run = tmp_path / "run"
    step = save_step(run)  # no run tokenizer recorded: as every checkpoint before this change
    cache_tokenizer = fake_tokenizer(run / "cache" / "tokenizer", "the cache's latest")
    with caplog.at_level(logging.WARNING):
        assert checkpoint_tokenizer(step) == cache_tokenizer
    assert any("records no tokenizer" in r.getMessage() for r in caplog.records)
    other = fake_tokenizer(tmp_path / "other", "anything")
    assert checkpoint_tokenizer(step, other) == other  # nothing to compare a given tokenizer with


def test_init_from_trains_with_the_recorded_tokenizer_in_place_of_the_default(tmp_path):
    a, b = fake_tokenizer(tmp_path / "a", "tokenizer A"), fake_tokenizer(tmp_path / "b", "tokenizer B")
    run = tmp_path / "run"
    record_run(run, a)
    weights = StartingWeights(save_step(run), None, {}, None)  # our checkpoint (config unused here)
    copy = str(run / "checkpoints" / "step-1" / "tokenizer")
    assert starting_tokenizer(str(b), True, weights) == copy  # the default (the cache's latest) is another
    assert starting_tokenizer(str(tmp_path / "unbuilt"), True, weights) == copy
    assert starting_tokenizer(str(a), True, weights) == str(a)  # the default is that tokenizer: kept
    assert starting_tokenizer(str(a), False, weights) == str(a)
    with pytest.raises(ConfigError, match=rf"tokenizer_dir={b} is not the tokenizer init_from=.*step-1 was trained"):
        starting_tokenizer(str(b), False, weights)
    assert starting_tokenizer(str(b), True, None) == str(b)  # random init: nothing recorded to follow


def test_a_run_copies_its_tokenizer_and_refuses_another_on_resume_or_from_init_from(tmp_path):
    a, b = fake_tokenizer(tmp_path / "a", "tokenizer A"), fake_tokenizer(tmp_path / "b", "tokenizer B")
    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved_config.yaml").write_text("trainer: {max_steps: 1}\n")
    cfg = SimpleNamespace(run_dir=str(run), checkpoint=CheckpointConfig())
    record = record_run_tokenizer(cfg, a)
    assert record == {"sha256": tokenizer_sha256(a), "source": str(a.resolve())}
    assert (run / "tokenizer" / "tokenizer.json").read_text() == "tokenizer A"
    resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert resolved["trainer"] == {"max_steps": 1} and resolved["run_tokenizer"]["sha256"] == record["sha256"]
    step = save_step(run)
    # resuming that checkpoint with another tokenizer (its corpus or tokenizer settings changed): refused
    with pytest.raises(ConfigError, match=r"the checkpoint it resumes, .*step-1, was trained with the tokenizer"):
        record_run_tokenizer(cfg, b)
    assert (run / "tokenizer" / "tokenizer.json").read_text() == "tokenizer A"
    assert record_run_tokenizer(cfg, a) == record  # the same one: resumes
    afresh = SimpleNamespace(run_dir=str(run), checkpoint=CheckpointConfig(resume=False))
    record_run_tokenizer(afresh, b)  # training from step 0 in the same run dir: its copy follows
    assert (run / "tokenizer" / "tokenizer.json").read_text() == "tokenizer B"
    # pretraining from that checkpoint on data packed with another tokenizer: refused, saying how to pack with it
    weights = StartingWeights(step, None, {}, None)
    other = SimpleNamespace(run_dir=str(tmp_path / "other"), checkpoint=CheckpointConfig())
    with pytest.raises(ConfigError) as refused:
        record_run_tokenizer(other, b, weights)
    message = str(refused.value)
    assert "\n" not in message and f"init_from={step} was trained with the tokenizer" in message
    assert tokenizer_sha256(a)[:12] in message and tokenizer_sha256(b)[:12] in message
    assert f"data.tokenizer_dir={step / 'tokenizer'}" in message
    assert not (tmp_path / "other" / "tokenizer").exists()


# -- slow: the recipes end to end, one cache dir rebuilt for a second corpus ---------------------------------


def corpus(path: Path, source: str, lines: int) -> Path:
    """A corpus of the first ``lines`` documents of one of the bundled files."""
    path.mkdir()
    with gzip.open(ROOT / "data" / "corpus" / source, "rt") as src, gzip.open(path / "part.jsonl.gz", "wt") as dst:
        for i, line in enumerate(src):
            if i >= lines:
                break
            dst.write(line)
    return path


def recipe(script: str, *overrides: str) -> subprocess.CompletedProcess:
    return run_python([sys.executable, str(ROOT / "recipes" / script), *overrides], cwd=ROOT, timeout=600,
                      env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def bits_per_byte(checkpoint: Path, out: Path, **options) -> float:
    from dsl_lit.config.evaluate import EvaluateConfig
    from dsl_lit.evaluation.checkpoint import evaluate_checkpoint

    cfg = EvaluateConfig(checkpoint=str(checkpoint), tasks=["dsl_devil_perplexity"], limit=4, bootstrap_iters=0,
                         device="cpu", **options)
    return evaluate_checkpoint(cfg, out)["results"]["dsl_devil_perplexity"]["bits_per_byte,none"]


@pytest.mark.slow
def test_a_cache_dir_rebuilt_for_another_corpus_leaves_an_earlier_run_its_tokenizer(tmp_path, caplog):
    from dsl_lit.checkpoint.export_hf import export
    from dsl_lit.config.data import DataConfig
    from dsl_lit.data.cache import prepare_cache
    from tests.recipe_runs import run_recipe

    cache, run_a = tmp_path / "cache", tmp_path / "run_a"
    corpus_a = corpus(tmp_path / "corpus_a", "devils_dictionary.jsonl.gz", 400)
    corpus_b = corpus(tmp_path / "corpus_b", "kjv_bible.jsonl.gz", 400)
    data = ["data.tokenizer_vocab_size=1024", "data.decontaminate=false"]
    run_recipe(run_a, f"data.corpus_dir={corpus_a}", f"data.cache_dir={cache}", *data, "trainer.max_steps=4",
               "checkpoint.every_n_steps=4", "logger=csv")
    step = run_a / "checkpoints" / "step-4"
    trained_with = (cache / "tokenizer" / "tokenizer.json").read_bytes()
    assert (run_a / "tokenizer" / "tokenizer.json").read_bytes() == trained_with
    assert (step / "tokenizer" / "tokenizer.json").read_bytes() == trained_with
    sha_a = json.loads((step / "meta.json").read_text())["tokenizer"]["sha256"]
    resolved = yaml.safe_load((run_a / "resolved_config.yaml").read_text())
    assert resolved["run_tokenizer"]["sha256"] == sha_a == tokenizer_sha256(cache / "tokenizer")
    before = bits_per_byte(run_a, tmp_path / "eval_before")

    # the same cache dir built for a second corpus: <cache_dir>/tokenizer is now its tokenizer
    prepare_cache(DataConfig(corpus_dir=str(corpus_b), cache_dir=str(cache), tokenizer_vocab_size=1024,
                             decontaminate=False))
    b_tokenizer = cache / "tokenizer"
    assert tokenizer_sha256(b_tokenizer) != sha_a

    # evaluation: the recorded tokenizer, the same bits per byte
    assert bits_per_byte(run_a, tmp_path / "eval_after") == before
    # (a checkpoint written before runs recorded theirs: the cache's latest, as before, and a warning)
    legacy = tmp_path / "legacy" / "checkpoints" / "step-4"
    shutil.copytree(step, legacy)
    shutil.rmtree(legacy / "tokenizer")
    meta = json.loads((legacy / "meta.json").read_text())
    del meta["tokenizer"]
    for key in ("files", "checksums"):
        meta[key] = {k: v for k, v in meta[key].items() if not k.startswith("tokenizer/")}
    (legacy / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        wrong = bits_per_byte(legacy, tmp_path / "eval_legacy")
    assert wrong != pytest.approx(before, rel=0.05)  # the bug this row reported, kept for old checkpoints ...
    assert any("records no tokenizer" in r.getMessage() for r in caplog.records)  # ... with a warning
    print(f"bits/byte of run A: {before} (before and after the rebuild), {wrong} read with the cache's latest")
    refused = one_line_error(recipe("evaluate.py", f"checkpoint={run_a}", "tasks=[dsl_devil_perplexity]",
                                    f"tokenizer_dir={b_tokenizer}", f"hydra.run.dir={tmp_path / 'eval_refused'}"))
    assert f"tokenizer_dir={b_tokenizer} is not the tokenizer" in refused and sha_a[:12] in refused
    assert tokenizer_sha256(b_tokenizer)[:12] in refused

    # the HF export packs the recorded tokenizer.json; another one given is refused
    export(run_a, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == trained_with
    spec = importlib.util.spec_from_file_location("export_hf_recipe", ROOT / "recipes" / "export_hf.py")
    export_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_hf)
    with pytest.raises(SystemExit, match=f"export_hf: error: tokenizer_dir={b_tokenizer} is not the tokenizer"):
        export_hf.main([f"checkpoint={run_a}", f"output={tmp_path / 'hf_b'}", f"tokenizer_dir={b_tokenizer}"])
    assert not (tmp_path / "hf_b").exists()

    # SFT from run A trains with A's tokenizer, not the cache's latest; given the cache's, it refuses
    sft = ["data.seq_len=128", "data.global_batch_size=8", "data.micro_batch_size=8", "trainer.max_steps=1",
           "checkpoint.every_n_steps=1", "logger=csv", "trainer.progress_bar=false", "task.num_problems=200", "task.eval_problems=0",
           "trainer.peak_tflops=1.0", f"data.cache_dir={cache}", f"init_from={run_a}"]
    result = recipe("sft.py", *sft, f"hydra.run.dir={tmp_path / 'sft'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "sft" / "tokenizer" / "tokenizer.json").read_bytes() == trained_with
    sft_step = tmp_path / "sft" / "checkpoints" / "step-1"
    assert json.loads((sft_step / "meta.json").read_text())["tokenizer"]["sha256"] == sha_a
    refused = one_line_error(recipe("sft.py", *sft, f"tokenizer_dir={b_tokenizer}",
                                    f"hydra.run.dir={tmp_path / 'sft_refused'}"))
    assert f"tokenizer_dir={b_tokenizer} is not the tokenizer init_from={step}" in refused

    # pretraining from run A on data packed with another tokenizer: refused, naming both
    refused = one_line_error(run_recipe(tmp_path / "continued", f"init_from={run_a}", f"data.corpus_dir={corpus_b}",
                                        f"data.cache_dir={cache}", *data, "trainer.max_steps=1", succeed=None))
    assert f"init_from={step} was trained with the tokenizer" in refused and tokenizer_sha256(b_tokenizer)[:12] in refused
