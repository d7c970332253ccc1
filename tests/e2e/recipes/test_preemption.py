"""Preemption on several ranks (issue: SIGTERM on a 2-process run hung in Lightning's handler,
which broadcasts from inside the signal handler, e.g. during a gradient all-reduce).

A SIGTERM to one rank or to all of them (SLURM signals every task): every rank finishes the
step, the step is saved once, every process exits 143 within seconds, and the rerun continues
with the uninterrupted run's losses."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, scratch_dir
from tests.forked_python import rank_pids, start_python
from tests.recipe_runs import SMALL, losses, run_recipe

TWO = ["logger=csv", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=10",
       "checkpoint.every_n_steps=100", "checkpoint.every_minutes=0", "checkpoint.async_save=false"]
EXIT_WITHIN_S = 60  # after the signal: the step in flight, one save, teardown (two shared CPU cores)


def _start(run_dir: Path, *overrides: str, lightning_launcher: bool = False) -> subprocess.Popen:
    """The recipe in its own session, so ``os.killpg`` reaches every rank. Its ranks are started
    torchrun's way (forked with their rank in the environment), or by rank 0 with Lightning's
    launcher (``lightning_launcher``: the only way rank 0 alone can be signalled)."""
    process = start_python(
        [sys.executable, str(ROOT / "recipes" / "pretrain.py"), *SMALL, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, stdout=f"{run_dir}.log", new_session=True, fork_ranks=not lightning_launcher,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    process.log = Path(f"{run_dir}.log")
    return process


def _wait_for_step(run_dir: Path, process: subprocess.Popen, step: int, timeout: float = 300) -> None:
    """Until metrics.csv has ``step`` (training is under way on every rank)."""
    deadline = time.monotonic() + timeout
    while step not in (losses(run_dir) if (run_dir / "metrics.csv").exists() else {}):
        assert process.poll() is None, process.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"training did not reach step {step}"
        time.sleep(0.05)


def _preempt(tmp_path: Path, name: str, who: str, *overrides: str, base: tuple[str, ...] = tuple(TWO)) -> tuple[Path, int]:
    run_dir = tmp_path / name
    process = _start(run_dir, *base, *overrides, lightning_launcher=who == "rank0_only")
    _wait_for_step(run_dir, process, 2)
    signalled = time.monotonic()
    if who == "all_ranks":
        os.killpg(process.pid, signal.SIGTERM)
    elif who == "rank0_only":
        process.send_signal(signal.SIGTERM)  # the launching process, which started the other ranks
    elif who == "last_rank":
        os.kill(rank_pids(process)[-1], signal.SIGTERM)
    else:  # another rank only: Lightning's handler broadcast from it alone and hung
        os.kill(rank_pids(process)[1], signal.SIGTERM)
    try:
        process.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"no exit within {EXIT_WITHIN_S} s of SIGTERM (hang): {process.log.read_text()[-3000:]}")
    output = process.log.read_text()
    assert process.returncode == 143, output[-3000:]
    match = re.search(r"SIGTERM at step (\d+): checkpoint saved", output)
    assert match, output[-3000:]
    step = int(match.group(1))
    assert time.monotonic() - signalled < EXIT_WITHIN_S
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith(".")) == [f"step-{step}"]
    return run_dir, step


@pytest.fixture(scope="module")
def uninterrupted(request: pytest.FixtureRequest) -> dict[int, str]:
    full = scratch_dir(request, "full")
    run_recipe(full, *TWO)
    return losses(full)


@pytest.mark.slow
@pytest.mark.parametrize("who", ["all_ranks"])  # rank 0 alone, rank 1 alone: the pipeline test; the last of 4: below
def test_sigterm_on_two_ranks_saves_once_exits_143_and_resumes_exactly(tmp_path, who, uninterrupted):
    preempted, step = _preempt(tmp_path, "preempted", who)
    assert 2 <= step < 10
    run_recipe(preempted, *TWO)
    assert losses(preempted) == uninterrupted


@pytest.mark.slow
@pytest.mark.parametrize("who", ["rank0_only", "rank1_only"])
def test_sigterm_under_pipeline_parallelism_saves_and_exits(tmp_path, who):
    _preempt(tmp_path, "pp", who, "parallel=pp_1f1b")


@pytest.mark.slow
def test_sigterm_on_four_ranks_under_tensor_and_expert_parallelism_resumes_exactly(tmp_path):
    """4 processes, tp=2 x ep=2 (tiny V3): the signal reaches ranks inside tensor- and
    expert-parallel collectives; the rerun gives the uninterrupted run's losses."""
    four = [*TWO[:2], "trainer.devices=4", "trainer.max_steps=6", *TWO[4:], "parallel.tp=2", "parallel.ep=2"]
    # only the last rank is signalled, as a node-local preemption notice would
    preempted, step = _preempt(tmp_path, "four", "last_rank", base=tuple(four))
    assert 2 <= step < 6
    run_recipe(preempted, *four)
    full = tmp_path / "full"
    run_recipe(full, *four)
    assert losses(preempted) == losses(full)


def _lose_rank_one(tmp_path: Path, how: int, *overrides: str) -> tuple[subprocess.Popen, float, str]:
    run_dir = tmp_path / "lost"
    process = _start(run_dir, *TWO, *overrides)
    _wait_for_step(run_dir, process, 2)
    rank1 = rank_pids(process)[1]
    lost_at = time.monotonic()
    os.kill(rank1, how)
    try:
        process.wait(timeout=120)
    finally:
        os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGKILL)
    return process, time.monotonic() - lost_at, process.log.read_text()


@pytest.mark.slow
def test_a_killed_rank_stops_the_others_naming_it_and_the_rerun_resumes(tmp_path, uninterrupted):
    process, seconds, output = _lose_rank_one(tmp_path, signal.SIGKILL, "checkpoint.every_n_steps=2")
    assert process.returncode not in (0, None) and seconds < 30, output[-3000:]
    # ours (torchrun, SLURM) or Lightning's launcher's watchdog, whichever stops rank 0 first
    assert re.search(r"lost rank\(s\) 1\b|\[rank: 1\] Child process with PID \d+ terminated", output), output[-3000:]
    run_recipe(tmp_path / "lost", *TWO, "checkpoint.every_n_steps=2")
    assert losses(tmp_path / "lost") == uninterrupted


@pytest.mark.slow
def test_a_hung_rank_stops_the_others_after_the_collective_timeout(tmp_path):
    """SIGSTOP: rank 1 is alive but never answers; rank 0 gives up after trainer.collective_timeout_s."""
    process, seconds, output = _lose_rank_one(tmp_path, signal.SIGSTOP, "trainer.collective_timeout_s=15")
    assert process.returncode not in (0, None), output[-3000:]
    assert 15 <= seconds < 15 + 45, output[-3000:]
    assert "lost rank(s) 1" in output, output[-3000:]
    # the report ends with the run dir and the command that resumes it (tests/e2e/recipes/test_resume_command.py runs one)
    assert re.search(r"lost rank\(s\) 1\. Resume from the latest complete checkpoint in \S+: run dir \S+; resume with: "
                     r"\S+ \S+/recipes/pretrain\.py .*hydra\.run\.dir=", output), output[-3000:]
