"""recipes/report.py (issue 21): PNG figures of a run from its metrics.csv.

Fast: the CSV reading (sparse rows; a step logged again after a resume keeps the newer value,
as RunCSVLogger writes it) and the expert-load grid in model order. Slow: on a run the test makes
(DeepSeek-V3 tiny: MTP, MoE, validation and in-loop evaluation), every figure is drawn and is a
real image; a directory without metrics.csv is a one-line error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dsl_lit.report.figures import LOAD_PREFIX, draw_report, natural_key
from dsl_lit.report.metrics import read_metrics
from dsl_lit.training.loggers import RunCSVLogger
from tests.conftest import ROOT
from tests.forked_python import run_python
from tests.recipe_runs import run_recipe


def test_read_metrics_sparse_rows_and_resumed_steps(tmp_path: Path) -> None:
    logger = RunCSVLogger(tmp_path)
    for step in range(4):
        logger.log_metrics({"train/loss": 5.0 - step, f"{LOAD_PREFIX}layers.10": 1.5, f"{LOAD_PREFIX}layers.2": 2.0},
                           step=step)
    logger.log_metrics({"val/loss": 4.5}, step=3)
    logger.save()
    resumed = RunCSVLogger(tmp_path)  # a resumed run re-logs step 3 onwards
    resumed.log_metrics({"train/loss": 1.25}, step=3)
    resumed.save()
    series = read_metrics(tmp_path)
    assert series["train/loss"].steps.tolist() == [0, 1, 2, 3]
    assert series["train/loss"].values.tolist() == [5.0, 4.0, 3.0, 1.25]
    assert "val/loss" not in series  # the resumed run replaced step 3's rows
    paths = draw_report(tmp_path)
    assert sorted(p.name for p in paths) == ["expert_load.png", "loss.png"]  # only what was logged
    layers = sorted([f"{LOAD_PREFIX}mtp.0", f"{LOAD_PREFIX}layers.10", f"{LOAD_PREFIX}layers.2"], key=natural_key)
    assert [k.removeprefix(LOAD_PREFIX) for k in layers] == ["layers.2", "layers.10", "mtp.0"]


def test_rl_figure_of_a_grpo_run(tmp_path: Path) -> None:
    """GRPO's columns (sampled rewards, pass@G, held-out accuracy logged every 10 steps, length)
    make one three-panel figure; a run without rewards gets none."""
    logger = RunCSVLogger(tmp_path)
    for step in range(21):
        logger.log_metrics({"reward/mean": 0.5 + step / 40, "reward/accuracy": step / 40, "reward/format": 0.9,
                            "reward/accuracy_pass_at_group": 0.8, "completion/length": 24.0 - step / 10}, step=step)
        if step % 10 == 0:
            logger.log_metrics({"eval/accuracy": 0.5 + step / 100}, step=step)
    logger.save()
    paths = draw_report(tmp_path)
    assert [p.name for p in paths] == ["rl.png"]
    pixels = np.asarray(Image.open(paths[0]).convert("L"), dtype=float)
    assert pixels.shape[1] > 3 * pixels.shape[0] and pixels.std() > 10  # three panels side by side, drawn
    assert read_metrics(tmp_path)["eval/accuracy"].steps.tolist() == [0, 10, 20]


@pytest.mark.slow
def test_report_of_a_real_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_recipe(run, "model=deepseek_v3_tiny", "trainer.max_steps=2", "logger=csv", "checkpoint.every_n_steps=0",
               "checkpoint.every_minutes=0", "data.val_windows=8", "trainer.val_every_n_steps=1",
               "eval.tasks=[dsl_kjv_next_sentence]", "eval.every_n_steps=2", "eval.limit=4")
    result = run_python([sys.executable, str(ROOT / "recipes" / "report.py"), f"run={run}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    names = ["loss", "lr", "grad_norm", "throughput", "aux_losses", "expert_load", "eval"]
    assert result.stdout.split() == [str(run / "report" / f"{n}.png") for n in names]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written but the figures
    for name in names:
        pixels = np.asarray(Image.open(run / "report" / f"{name}.png").convert("L"), dtype=float)
        assert pixels.shape[0] > 200 and pixels.std() > 10, name  # drawn, not blank
    bad = run_python([sys.executable, str(ROOT / "recipes" / "report.py"), f"run={tmp_path}"], cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "holds no metrics.csv" in bad.stderr


def test_a_run_whose_losses_are_nan_is_said_not_silently_left_out(tmp_path: Path) -> None:
    """Before: a column that was NaN at every step drew no figure and the report said nothing."""
    from dsl_lit.report.metrics import non_finite_steps

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("step,train/loss,train/lr\n0,nan,0.001\n1,nan,0.002\n2,inf,0.003\n")
    assert non_finite_steps(run) == {"train/loss": (3, 3)}
    result = run_python([sys.executable, str(ROOT / "recipes" / "report.py"), f"run={run}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "warning: train/loss is NaN or inf at 3 of its 3 steps (not drawn): the run diverged" in result.stderr
    assert (run / "report" / "lr.png").is_file() or any((run / "report").glob("*.png"))
