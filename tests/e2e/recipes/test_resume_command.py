"""The command an early stop prints resumes the run, also with the default (start-time) run_name;
``run_name=latest`` resumes the recipe's newest run; without one it is a one-line error."""

from __future__ import annotations

import csv
import logging
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from dsl_lit.training import build
from dsl_lit.training.resume_command import resume_command, stop_hint
from tests.conftest import ROOT
from tests.forked_python import run_python, start_python
from tests.recipe_runs import SMALL

RECIPE = str(ROOT / "recipes" / "pretrain.py")
ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
# no hydra.run.dir: the run dir is outputs/pretrain/${run_name} under the working directory (tmp_path)
RUN = [*SMALL, "logger=csv", "trainer.accelerator=cpu", "checkpoint.every_n_steps=2", "checkpoint.every_minutes=0"]


def cfg(run_dir: str | Path, run_name: str | None) -> SimpleNamespace:
    return SimpleNamespace(run_dir=str(run_dir), raw={} if run_name is None else {"run_name": run_name})


def test_the_command_pins_the_resolved_run_name_and_keeps_the_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = cfg(tmp_path / "outputs/pretrain/2025-01-02_03-04-05", "2025-01-02_03-04-05")
    argv = ["recipes/pretrain.py", "optim.lr=1e-3", "data.paths=[a b,c]", "run_name=latest", "-cn", "pretrain"]
    command = shlex.split(resume_command(run, argv))
    assert command[1:] == ["recipes/pretrain.py", "-cn", "pretrain", "optim.lr=1e-3", "data.paths=[a b,c]",
                           "run_name=2025-01-02_03-04-05"]
    assert command[0] in ("python", sys.executable)  # python when it is this interpreter
    assert stop_hint(run, argv).startswith("run dir outputs/pretrain/2025-01-02_03-04-05; resume with: ")
    # a nested name (run_name=exp/a) is kept whole; +run_name / ++run_name given are replaced
    nested = cfg(tmp_path / "outputs/pretrain/exp/a", "exp/a")
    assert shlex.split(resume_command(nested, ["r.py", "++run_name=exp/a"]))[2:] == ["run_name=exp/a"]


def test_a_rank_started_by_lightning_prints_the_launching_command(tmp_path):
    """A rank re-resolves ``${now:...}`` (its run_name is a later second) and carries the overrides
    Lightning's launcher appended; the command is the launching process's."""
    run = cfg(tmp_path / "outputs/pretrain/2025-01-02_03-04-05", "2025-01-02_03-04-06")
    argv = ["r.py", "trainer.devices=2", f'hydra.run.dir="{run.run_dir}"', "hydra.job.name=train_ddp_process_1",
            "hydra.output_subdir=null"]
    assert shlex.split(resume_command(run, argv))[2:] == ["trainer.devices=2", "run_name=2025-01-02_03-04-05"]


def test_a_run_dir_given_outright_is_kept_without_a_run_name(tmp_path):
    run = cfg(tmp_path / "mine", "2025-01-02_03-04-05")
    assert shlex.split(resume_command(run, ["r.py", f"hydra.run.dir={run.run_dir}"]))[2:] == [
        f"hydra.run.dir={run.run_dir}"]
    templated = cfg(tmp_path / "runs/x", "x")  # hydra.run.dir=<dir>/${run_name}: the name is pinned
    assert shlex.split(resume_command(templated, ["r.py", "hydra.run.dir=runs/${run_name}"]))[2:] == [
        "hydra.run.dir=runs/${run_name}", "run_name=x"]


class _StoppingTrainer:
    """``build_trainer``'s stand-in: its fit raises what a stopped run raises."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.global_step, self.is_global_zero = error, 5, True

    def fit(self, *args, **kwargs) -> None:
        raise self.error


@pytest.mark.parametrize(("error", "code", "reason"), [
    (SIGTERMException(), 143, "SIGTERM at step 5: checkpoint saved; "),
    (FloatingPointError("3 optimizer steps in a row were skipped (step 5: the loss is nan); stopping with the last "
                        "good checkpoint intact"), 1, "stopped at step 5: 3 optimizer steps in a row were skipped"),
])
def test_every_stop_logs_the_run_dir_and_the_resume_command(tmp_path, monkeypatch, caplog, error, code, reason):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["recipes/pretrain.py", "optim.lr=1e-3"])
    monkeypatch.setattr(build, "build_trainer", lambda cfg: _StoppingTrainer(error))
    monkeypatch.setattr(build, "resume_path", lambda cfg: None)
    run = cfg(tmp_path / "outputs/pretrain/2025-01-02_03-04-05", "2025-01-02_03-04-05")
    with caplog.at_level(logging.WARNING, logger=build.log.name), pytest.raises(SystemExit) as stop:
        build.fit(run, None, None)
    assert stop.value.code == code
    [line] = [r.getMessage() for r in caplog.records if r.name == build.log.name]
    assert reason in line and line.endswith(
        "run dir outputs/pretrain/2025-01-02_03-04-05; resume with: " + resume_command(run)), line
    assert line.split("resume with: ")[1].split()[1:] == ["recipes/pretrain.py", "optim.lr=1e-3",
                                                          "run_name=2025-01-02_03-04-05"]


def _runs(cwd: Path) -> list[str]:
    return sorted(p.name for p in (cwd / "outputs" / "pretrain").iterdir())


def _steps(run_dir: Path) -> list[int]:
    with (run_dir / "metrics.csv").open() as f:
        return sorted({int(float(r["step"])) for r in csv.DictReader(f) if r.get("train/loss")})


def _fresh_metrics(run_dir: Path) -> None:
    """Drop metrics.csv, so what it holds after the next run is that run's steps alone."""
    (run_dir / "metrics.csv").unlink()


@pytest.mark.slow
def test_the_printed_command_resumes_a_default_named_run_and_latest_resumes_the_newest(tmp_path):
    # an older finished run, named: run_name=latest must not pick it
    older = run_python([sys.executable, RECIPE, *RUN, "trainer.max_steps=2", "run_name=older"], cwd=tmp_path, env=ENV,
                       timeout=300)
    assert older.returncode == 0, older.stderr[-3000:]

    # a run with the default run_name (the start time), stopped by SIGTERM after its step-2 checkpoint
    log = tmp_path / "preempted.log"
    process = start_python([sys.executable, RECIPE, *RUN, "trainer.max_steps=8"], cwd=tmp_path, env=ENV, stdout=log)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("outputs/pretrain/20*/checkpoints/step-2/meta.json")):
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no step-2 checkpoint"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 143, log.read_text()[-3000:]
    output = log.read_text()
    match = re.search(r"SIGTERM at step (\d+): checkpoint saved; run dir (\S+); resume with: (.+)$", output, re.M)
    assert match, output[-3000:]
    step, shown_dir, command = int(match.group(1)), match.group(2), match.group(3)
    [name] = [n for n in _runs(tmp_path) if n != "older"]
    run_dir = tmp_path / "outputs" / "pretrain" / name
    assert shown_dir == f"outputs/pretrain/{name}" and command.endswith(f" run_name={name}"), match.group(0)
    assert 2 <= step < 8 and (run_dir / "checkpoints" / f"step-{step}" / "meta.json").exists()
    _fresh_metrics(run_dir)

    # the printed command, as printed, from the same directory: the same run dir, from the checkpoint on
    resumed = run_python(shlex.split(command), cwd=tmp_path, env=ENV, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _runs(tmp_path) == sorted(["older", name])
    assert _steps(run_dir) == list(range(step, 8)), resumed.stderr[-3000:]
    _fresh_metrics(run_dir)

    # run_name=latest: the run whose checkpoint is newest (this one, not "older"), continued to step 10
    latest = run_python([sys.executable, RECIPE, *RUN, "trainer.max_steps=10", "run_name=latest"], cwd=tmp_path,
                        env=ENV, timeout=300)
    assert latest.returncode == 0, latest.stderr[-3000:]
    assert f"run_name=latest: resuming outputs/pretrain/{name} (run_name={name})" in latest.stderr + latest.stdout
    assert _runs(tmp_path) == sorted(["older", name])
    assert _steps(run_dir) == [8, 9]


@pytest.mark.slow
def test_latest_without_a_run_to_resume_is_one_line_and_exit_2(tmp_path):
    result = run_python([sys.executable, RECIPE, "run_name=latest"], cwd=tmp_path, env=ENV, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: run_name=latest: no run under outputs/pretrain has a complete checkpoint to resume; start one "
        "without run_name=latest (or name a run: run_name=<name>)"]
    assert not (tmp_path / "outputs").exists()  # no run dir named "latest" was made


def test_a_multirun_job_resumes_as_a_single_run_of_its_own_overrides(tmp_path, monkeypatch):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    job_dir = tmp_path / "multirun/pretrain/2025-01-02_03-04-05/1"
    monkeypatch.setattr(HydraConfig.instance(), "cfg", OmegaConf.create({"hydra": {
        "mode": RunMode.MULTIRUN, "overrides": {"task": ["optim.lr=3e-3"]}, "runtime": {"output_dir": str(job_dir)}}}))
    run = cfg(job_dir, "2025-01-02_03-04-06")
    argv = ["r.py", "-m", "optim.lr=1e-3,3e-3", "hydra.job.chdir=false", "hydra.sweep.dir=sweeps"]
    assert shlex.split(resume_command(run, argv))[1:] == [
        "r.py", "optim.lr=3e-3", "hydra.job.chdir=false", "hydra.run.dir=multirun/pretrain/2025-01-02_03-04-05/1"]


def test_a_stage_in_a_subfolder_of_the_run_resumes_the_recipes_run(tmp_path, monkeypatch):
    """GRPO's cold start trains in ``<run dir>/cold_start``: the command names the recipe's run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "outputs/grpo/2025-01-02_03-04-05"
    monkeypatch.setattr(HydraConfig.instance(), "cfg", OmegaConf.create({"hydra": {
        "mode": RunMode.RUN, "overrides": {"task": []}, "runtime": {"output_dir": str(run_dir)}}}))
    stage = cfg(run_dir / "cold_start", "2025-01-02_03-04-05")
    assert shlex.split(resume_command(stage, ["recipes/grpo.py"]))[2:] == ["run_name=2025-01-02_03-04-05"]
    assert stop_hint(stage, ["recipes/grpo.py"]).startswith("run dir outputs/grpo/2025-01-02_03-04-05/cold_start; ")
