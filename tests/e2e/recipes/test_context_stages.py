"""Context-extension stages (DeepSeek-V3 section 4.3 on CPU): a stage starts from the previous
stage's weights and architecture (``init_from``) and trains at its own length under its own YaRN
scaling; the passkey recipe scores the result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from dsl_lit.checkpoint.reader import find_checkpoint, read_model_weights
from dsl_lit.tasks.passkey import PasskeyCorpus, write_corpus
from tests.conftest import ROOT
from tests.forked_python import run_python
from tests.recipe_runs import losses

COMMON = ["logger=csv", "trainer.accelerator=cpu", "checkpoint.every_minutes=0", "checkpoint.async_save=false",
          "trainer.progress_bar=false", "trainer.log_every_n_steps=1"]


def _run(run_dir: Path, *overrides: str) -> None:
    result = run_python([sys.executable, str(ROOT / "recipes" / "pretrain.py"), *COMMON, f"hydra.run.dir={run_dir}",
                         *overrides], cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _stage_config(run_dir: Path) -> dict:
    step = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return yaml.safe_load((step / "config.yaml").read_text())["model"]


@pytest.mark.slow
def test_stages_start_from_the_previous_stage_at_their_own_length(tmp_path: Path) -> None:
    short = PasskeyCorpus("short", documents=600, min_filler=2, max_filler=16, seed=0)
    medium = PasskeyCorpus("medium", documents=60, min_filler=16, max_filler=80, seed=1)
    for corpus in (short, medium):
        write_corpus(corpus, tmp_path / "corpora")
    base, stage = tmp_path / "base", tmp_path / "stage"
    # stage 0 (2 layers): the stage must take this architecture, not its own preset's (4 layers)
    _run(base, *COMMON, "experiment=cpu_context_128", "trainer.max_steps=8",
               "data.global_batch_size=8", "data.micro_batch_size=8", f"data.corpus_dir={tmp_path / 'corpora' / 'short'}",
               f"data.cache_dir={tmp_path / 'cache_short'}", "schedule.warmup_steps=2")
    _run(stage, *COMMON, "experiment=cpu_context_512", f"init_from={base}", "trainer.max_steps=2",
               f"data.corpus_dir={tmp_path / 'corpora' / 'medium'}", f"data.cache_dir={tmp_path / 'cache_medium'}",
               f"data.tokenizer_dir={tmp_path / 'cache_short' / 'tokenizer'}")

    base_model, stage_model = _stage_config(base), _stage_config(stage)
    assert (base_model["max_seq_len"], base_model.get("rope_scaling")) == (128, None)
    assert stage_model["n_layers"] == 2 and stage_model["vocab_size"] == 1024
    assert stage_model["max_seq_len"] == 512
    assert stage_model["rope_scaling"]["factor"] == 4 and stage_model["rope_scaling"]["original_max_seq_len"] == 128
    # the base's weights: two AdamW steps at lr 2e-4 move no weight more than ~1.3 lr each (a fresh
    # init would differ from the base by ~0.006 per weight, and by several times that at the most)
    trained, extended = (read_model_weights(find_checkpoint(run)) for run in (base, stage))
    assert trained.keys() == extended.keys()
    moved = max((extended[k] - trained[k]).abs().max().item() for k in trained if not k.endswith("expert_bias"))
    assert moved < 5 * 2e-4 * 2, moved
    first, last = float(losses(stage)[0]), float(list(losses(base).values())[-1])
    assert first < last + 1.0, (first, last)  # longer documents of the same kind

    out = tmp_path / "passkey"
    result = run_python([sys.executable, str(ROOT / "recipes" / "passkey.py"), f"checkpoint={stage}",
                         "lengths=[128,512]", "depths=[0.5]", "per_depth=2", f"hydra.run.dir={out}"], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads((out / "passkey.json").read_text())
    assert set(scores["accuracy"]) == set(scores["retrieved"]) == {"128", "512"}
    assert {n: [len(hits) for hits in row.values()] for n, row in scores["retrieved"].items()} == {"128": [2], "512": [2]}
    assert scores["rope_scaling"]["factor"] == 4  # the stage's own scaling, read from its checkpoint
    assert "| 512 |" in result.stdout
