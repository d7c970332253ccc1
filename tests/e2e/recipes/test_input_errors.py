"""Every input file a user names to a recipe, when wrong, is one line and exit 2 (issue 34, item 6):
before, these were tracebacks with exit 1, or (empty metrics) an exit 0 with an empty report."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.forked_python import run_python


def recipe(name: str, *args: str, cwd: Path):
    return run_python([sys.executable, str(ROOT / "recipes" / name), *args], cwd=cwd, timeout=300,
                      env={**os.environ, "WANDB_MODE": "offline"})


def assert_one_line(result, message: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_recipes_refuse_bad_input_files_in_one_line(tmp_path):
    not_a_checkpoint = tmp_path / "notes"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "README").write_text("hello")
    assert_one_line(recipe("evaluate.py", f"checkpoint={not_a_checkpoint}", cwd=tmp_path),
                    "is not a checkpoint directory")
    assert_one_line(recipe("evaluate.py", f"checkpoint={tmp_path / 'missing'}", cwd=tmp_path), "no such directory")
    assert_one_line(recipe("report.py", cwd=tmp_path), "run= is required")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("step,train/loss\n")
    assert_one_line(recipe("report.py", f"run={run}", cwd=tmp_path), "holds no step with a metric to draw")
    (run / "metrics.csv").write_bytes(os.urandom(4096))
    assert_one_line(recipe("report.py", f"run={run}", cwd=tmp_path), "metrics.csv")
    assert not (run / "report").exists()


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(tmp_path):
    """``model=deepseek_v3_671b`` on this machine: one line from the planner's memory estimate, exit 2,
    no data built and nothing allocated (before: the model grew to the memory limit and died)."""
    result = recipe("pretrain.py", "model=deepseek_v3_671b", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}",
                    f"data.cache_dir={tmp_path / 'never_built'}", cwd=tmp_path)
    assert_one_line(result, "model.name=deepseek_v3_671b needs ~")
    assert "GiB per process" in result.stderr and "parallel.tp/pp/ep" in result.stderr
    assert not (tmp_path / "never_built").exists()


def test_the_memory_check_follows_the_planners_estimate():
    from data_contract.errors import ConfigError
    from dsl_lit.config import TrainConfig
    from dsl_lit.scaling.planner.fits import plan_layout_of, refuse_what_cannot_fit
    from dsl_lit.scaling.planner.memory import estimate_memory
    from tests.conftest import compose_config

    cfg = TrainConfig.from_hydra(compose_config(overrides=["model=deepseek_llm_tiny"]))
    needed = estimate_memory(cfg.model, plan_layout_of(cfg)).total
    refuse_what_cannot_fit(cfg, available=int(needed) + 1)
    with pytest.raises(ConfigError, match=r"^model\.name=deepseek_llm_tiny needs ~0\.2 GiB per process"):
        refuse_what_cannot_fit(cfg, available=int(needed) - 1)
