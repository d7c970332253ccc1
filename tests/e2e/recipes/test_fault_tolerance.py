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

from tests.conftest import ROOT, scratch_dir
from tests.forked_python import start_python
from tests.recipe_runs import SMALL, losses, run_recipe

# DeepSeek-V3 (MLA, MoE with its balancing bias, MTP): the most state a resume has to restore exactly
RUN = ["logger=csv", "trainer.accelerator=cpu", "trainer.max_steps=8", "checkpoint.every_n_steps=2",
       "checkpoint.every_minutes=0"]


def _start(run_dir: Path, *overrides: str, launcher: Path | None = None, **env: str) -> subprocess.Popen:
    """The recipe in the background (through ``launcher`` if given); its output goes to
    ``<run_dir>.log`` (a pipe could fill up)."""
    process = start_python(
        [sys.executable, *([str(launcher)] if launcher else []), str(ROOT / "recipes" / "pretrain.py"), *SMALL, *RUN,
         f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT, stdout=f"{run_dir}.log", env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **env},
    )
    process.log = Path(f"{run_dir}.log")
    return process


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the run ended before {path.name} appeared: {process.log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(request: pytest.FixtureRequest) -> dict[int, str]:
    """The losses of the run every interrupted one must reproduce (saving does not change them)."""
    full = scratch_dir(request, "full")
    run_recipe(full, *RUN)
    return losses(full)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_the_rerun_continues(tmp_path, uninterrupted):
    preempted = tmp_path / "preempted"
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
    assert losses(preempted) == uninterrupted


SLOW_DISK = """
import os, runpy, sys, time
from torch.distributed.checkpoint import HuggingFaceStorageWriter

original = HuggingFaceStorageWriter.write_data


def slow_write(self, plan, planner):  # a slow disk: each shard write takes seconds
    time.sleep(float(os.environ["SLOW_DISK_S"]))
    return original(self, plan, planner)


HuggingFaceStorageWriter.write_data = slow_write
recipe = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(recipe, run_name="__main__")
"""


@pytest.mark.slow
def test_sigkill_during_a_save_then_rerun_reproduces_the_uninterrupted_losses(tmp_path, uninterrupted):
    """SIGKILL in the middle of training while step-4's shards are being written in the background (a
    slow disk keeps the write in flight): the half-written ``.tmp-step-4`` is never used, the same
    command resumes from step-2 and reproduces the uninterrupted losses bit for bit."""
    killed = tmp_path / "killed"
    launcher = tmp_path / "slow_disk.py"
    launcher.write_text(SLOW_DISK)
    process = _start(killed, launcher=launcher, SLOW_DISK_S="4")
    _wait_for(killed / "checkpoints" / ".tmp-step-4" / "trainer_state.pt", process)
    time.sleep(0.5)  # inside the 4 s write of step 4's shards
    process.send_signal(signal.SIGKILL)
    process.wait()
    checkpoints = killed / "checkpoints"
    assert (checkpoints / ".tmp-step-4").is_dir() and not (checkpoints / "step-4").exists()
    assert (checkpoints / "step-2" / "meta.json").is_file()
    run_recipe(killed, *RUN)
    assert losses(killed) == uninterrupted
    assert not (checkpoints / ".tmp-step-4").exists()  # the leftover was swept
