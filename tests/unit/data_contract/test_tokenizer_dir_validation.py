"""A tokenizer directory a user names (``tokenizer.path`` of the data pipeline, ``data.tokenizer_dir``
and ``tokenizer_dir`` of the recipes) is checked whole before any stage or step runs: each defect is
one ConfigError naming the field and the file (issue 34, row 7: before, 15 such cases were
tracebacks with exit 1, and the pipeline's checks ran only after ingest and normalize)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from data_contract.errors import ConfigError
from data_contract.tokenizer_dir import validate_tokenizer_dir
from tests.conftest import ROOT
from tests.forked_python import run_python


def good_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2}, unk_token="a")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return path


def truncated(path: Path) -> None:
    text = (path / "tokenizer.json").read_text()
    (path / "tokenizer.json").write_text(text[: len(text) // 2])


def config(value) -> callable:
    return lambda path: (path / "tokenizer_config.json").write_text(json.dumps(value))


def meta(value) -> callable:
    return lambda path: (path / "meta.json").write_text(json.dumps(value))


CASES = {
    "truncated tokenizer.json": (truncated, r"tokenizer\.json is not valid JSON .*truncated"),
    "a list as config": (config(["eos_token", "<eos>"]), r"tokenizer_config\.json holds a JSON list where a JSON object belongs"),
    "no eos": (config({}), r"names no eos_token that tokenizer\.json holds"),
    "eos not in the vocabulary": (config({"eos_token": "</s>"}), r"names no eos_token .*'</s>'"),
    "eos id -5": (meta({"vocab_size": 3, "eos_id": -5, "pad_id": 2}), r"eos_id=-5 is not a token id of its 3-token"),
    "eos id out of vocab": (meta({"vocab_size": 3, "eos_id": 7, "pad_id": 2}), r"eos_id=7 is not a token id"),
    "not a tokenizer": (lambda p: (p / "tokenizer.json").write_text('{"model": 3}'), r"does not load as a tokenizer"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_defect_is_one_config_error_naming_the_field(tmp_path, case):
    directory = good_dir(tmp_path / "tok")
    validate_tokenizer_dir(directory, "tokenizer.path")  # the good one passes
    corrupt, message = CASES[case]
    corrupt(directory)
    with pytest.raises(ConfigError, match=message) as error:
        validate_tokenizer_dir(directory, "tokenizer.path")
    assert "\n" not in str(error.value)
    assert "tokenizer.path" in str(error.value) or str(directory) in str(error.value)


@pytest.mark.slow
def test_the_pipeline_and_the_recipe_refuse_before_any_stage_or_data(tmp_path):
    directory = good_dir(tmp_path / "tok")
    truncated(directory)
    env = {**os.environ, "WANDB_MODE": "offline"}
    out = tmp_path / "out"
    pipeline = run_python([sys.executable, "-m", "data_pipeline", f"input.path={ROOT / 'data' / 'corpus'}",
                           f"output_dir={out}", f"tokenizer.path={directory}",
                           "stages=[normalize,exact_dedup,tokenize_pack]"], cwd=ROOT, timeout=300, env=env)
    assert pipeline.returncode == 2, pipeline.stderr[-2000:]
    said = pipeline.stdout + pipeline.stderr
    assert "Traceback" not in said and "is not valid JSON" in said
    assert not (out / "normalize").exists() and not (out / "exact_dedup").exists()
    recipe = run_python([sys.executable, str(ROOT / "recipes" / "pretrain.py"), f"hydra.run.dir={tmp_path / 'run'}",
                         f"data.tokenizer_dir={directory}", f"data.cache_dir={tmp_path / 'cache'}", "logger=csv"],
                        cwd=ROOT, timeout=300, env=env)
    assert recipe.returncode == 2, recipe.stderr[-2000:]
    errors = [line for line in recipe.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is not valid JSON" in errors[0], recipe.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_a_dangling_link_output_dir_is_one_line(tmp_path):
    """Before: Hydra's FileExistsError traceback, exit 1."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    result = run_python([sys.executable, "-m", "data_pipeline", f"input.path={ROOT / 'data' / 'corpus'}",
                         f"output_dir={link}", "stages=[normalize]"], cwd=ROOT, timeout=120, env=dict(os.environ))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "is a symbolic link to" in result.stderr
    assert not (tmp_path / "nowhere").exists()
