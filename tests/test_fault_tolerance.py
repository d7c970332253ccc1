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
import torch

from tests.test_pretrain_e2e import ROOT, SMALL, losses, metric, run_recipe

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
def test_sigkill_during_a_save_then_rerun_reproduces_the_uninterrupted_losses(tmp_path):
    """Killed while step-4's shards are being written (a slow disk keeps the write in flight): the
    half-written ``.tmp-step-4`` is never used, the rerun resumes from step-2 and matches bit for bit."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    run_recipe(full, *RUN)
    launcher = tmp_path / "slow_disk.py"
    launcher.write_text(SLOW_DISK)
    process = subprocess.Popen(
        [sys.executable, str(launcher), str(ROOT / "recipes" / "pretrain.py"), *SMALL, *RUN, f"hydra.run.dir={killed}"],
        cwd=ROOT, stdout=open(f"{killed}.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "SLOW_DISK_S": "4"},
    )
    process.log = Path(f"{killed}.log")
    _wait_for(killed / "checkpoints" / ".tmp-step-4" / "trainer_state.pt", process)
    time.sleep(0.5)  # inside the 4 s write of step 4's shards
    process.send_signal(signal.SIGKILL)
    process.wait()
    checkpoints = killed / "checkpoints"
    assert (checkpoints / ".tmp-step-4").is_dir() and not (checkpoints / "step-4").exists()
    assert (checkpoints / "step-2" / "meta.json").is_file()
    run_recipe(killed, *RUN)
    assert losses(killed) == losses(full)
    assert not (checkpoints / ".tmp-step-4").exists()  # the leftover was swept


LAYOUT_RUN = ["logger=csv", "trainer.accelerator=cpu", "trainer.max_steps=6", "checkpoint.every_minutes=0",
              "data.micro_batch_size=2"]


def _consumed_samples(run_dir: Path, step: int) -> int:
    state = torch.load(run_dir / "checkpoints" / f"step-{step}" / "trainer_state.pt", weights_only=True)
    return state["PretrainDataModule"]["consumed_samples"]


@pytest.mark.slow
def test_checkpoints_resume_under_another_layout(tmp_path):
    """1 process -> TP=2; DP=2 + ZeRO-1 -> PP=2 and -> 1 process: every resumed run continues the
    uninterrupted one-process run's losses (within 2e-3) on the same data: nothing repeated or skipped."""
    runs = {
        "single": (["trainer.devices=1", "checkpoint.every_n_steps=3"], None),
        "tp2": (["trainer.devices=2", "parallel.tp=2", "checkpoint.every_n_steps=0"], "single"),
        "zero1": (["trainer.devices=2", "parallel=zero1", "checkpoint.every_n_steps=3", "trainer.max_steps=3"], None),
        "pp2": (["trainer.devices=2", "parallel=pp_1f1b", "checkpoint.every_n_steps=6"], "zero1"),
        "dp1": (["trainer.devices=1", "checkpoint.every_n_steps=6"], "zero1"),
    }
    for name, (overrides, source) in runs.items():
        resume = [f"checkpoint.resume_from={tmp_path / source / 'checkpoints' / 'step-3'}"] if source else []
        run_recipe(tmp_path / name, *LAYOUT_RUN, *overrides, *resume)
    reference = losses(tmp_path / "single")
    tokens = metric(tmp_path / "single", "perf/tokens_seen")
    assert sorted(losses(tmp_path / "zero1")) == [0, 1, 2]
    for name, (_, source) in runs.items():
        steps = [3, 4, 5] if source else sorted(losses(tmp_path / name))
        assert sorted(losses(tmp_path / name)) == steps, name
        for step in steps:
            assert float(losses(tmp_path / name)[step]) == pytest.approx(float(reference[step]), rel=2e-3), (name, step)
            assert metric(tmp_path / name, "perf/tokens_seen")[step] == tokens[step], (name, step)
    assert _consumed_samples(tmp_path / "zero1", 3) == 3 * 8
    for name in ("single", "pp2", "dp1"):
        assert _consumed_samples(tmp_path / name, 6) == 6 * 8, name
