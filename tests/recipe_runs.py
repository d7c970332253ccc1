"""Running the pretraining recipe as a user does, in a subprocess, and reading what it logged: the
helpers every end-to-end test shares."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.forked_python import run_python

SMALL = [
    "+model.n_layers=2", "data.seq_len=64", "data.global_batch_size=8", "data.micro_batch_size=4",
    "optim.lr=3e-3", "schedule.warmup_steps=2", "schedule.total_steps=12", "trainer.progress_bar=false", "trainer.log_every_n_steps=1",
    # MFU's denominator given: measuring it takes ~1 s per rank per run (test_train_log_and_checkpoint measures)
    "trainer.peak_tflops=1.0",
    # CSV only: a W&B offline run costs ~2 CPU-s a run (its import and service), and the suite runs
    # ~100; test_train_log_and_checkpoint runs the default loggers (W&B + CSV) and checks W&B's files
    "logger=csv",
]


def run_recipe(run_dir: Path, *overrides: str, succeed: bool | None = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """The pretrain recipe in a subprocess, killed after ``timeout`` s; asserts it exits 0
    (``succeed=False``: that it does not; None: no assertion)."""
    result = run_python(
        [sys.executable, str(ROOT / "recipes" / "pretrain.py"), *SMALL, f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT, timeout=timeout, env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    if succeed is not None:
        assert (result.returncode == 0) == succeed, result.stderr[-3000:]
    return result


def metric(run_dir: Path, key: str) -> dict[int, str]:
    """``key`` per step from the run's metrics.csv (as written, so equality is bit for bit)."""
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): r[key] for r in csv.DictReader(f) if r.get(key)}


def losses(run_dir: Path) -> dict[int, str]:
    return metric(run_dir, "train/loss")
