"""Real signals against the real recipe: SIGKILL at an arbitrary moment, then the same command
again, continues from the latest complete checkpoint and reproduces an uninterrupted run's losses
bit for bit; SIGTERM (SLURM's preemption warning) saves the current step and exits resumable."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_pretrain_e2e import ROOT, SMALL, losses, run_recipe

RUN = ["logger=csv", "trainer.accelerator=cpu", "trainer.max_steps=8", "checkpoint.every_n_steps=2",
       "checkpoint.every_minutes=0", "model=deepseek_llm_tiny"]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """The recipe in the background; its output goes to ``<run_dir>.log`` (a pipe could fill up)."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "recipes" / "pretrain.py"), *SMALL, *RUN, f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT, stdout=open(f"{run_dir}.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    process.log = Path(f"{run_dir}.log")
    return process


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the run ended before {path.name} appeared: {process.log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_then_rerun_reproduces_the_uninterrupted_losses(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    run_recipe(full, *RUN)
    process = _start(killed)
    _wait_for(killed / "checkpoints" / "step-4", process)
    time.sleep(0.3)  # somewhere inside step 5 or 6 (or a save): an arbitrary moment
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "step-8").exists()
    run_recipe(killed, *RUN)  # the same command: resumes from the latest complete checkpoint
    assert sorted(losses(killed)) == list(range(8))
    assert losses(killed) == losses(full)  # bit for bit (the CSV keeps the digits as logged)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_the_rerun_continues(tmp_path):
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    run_recipe(full, *RUN, "checkpoint.every_n_steps=3")
    process = _start(preempted, "checkpoint.every_n_steps=3")
    _wait_for(preempted / "checkpoints" / "step-3", process)  # training is under way
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=300)
    output = process.log.read_text()
    assert process.returncode == 143, output[-2000:]
    match = re.search(r"SIGTERM at step (\d+): checkpoint saved", output)
    assert match, output[-2000:]
    step = int(match.group(1))
    assert 0 < step < 8 and (preempted / "checkpoints" / f"step-{step}" / "meta.json").exists()
    run_recipe(preempted, *RUN, "checkpoint.every_n_steps=3")
    assert losses(preempted) == losses(full)
