"""Run the stages of a reproduction in order: each in a directory of its own, finished when its
completion marker is there, so a rerun skips what is done and resumes what was interrupted (the
recipes resume from their run directory's latest checkpoint).

Each recipe runs as a child process (its own Hydra app, logging and memory; on CPU forked from
this preloaded interpreter, :mod:`.stage_process`), its output in ``<stage>/stage.log``; SIGTERM
to this process reaches the child, which saves a checkpoint and exits, and no marker is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.reproduce import ReproduceConfig
from dsl_lit.config.reproduce_stages import StageRow
from dsl_lit.reproduce.run_dir_lock import hold_run_dir
from dsl_lit.reproduce.stage_process import StageProcess, preload, start_stage

log = logging.getLogger(__name__)

MARKER = "DONE.json"
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def path_override(key: str, path: Path | str) -> str:
    """``key='<path>'``: quoted, so a path with spaces, commas, brackets or ``=`` stays one value to Hydra."""
    # Hydra's quoted strings: a backslash escapes only a quote or the backslashes before one
    escaped = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), str(path))
    return f"{key}='{escaped}'"


class StageFailed(RuntimeError):
    """A stage's recipe exited non-zero; the message names its log."""


STARTED = "STARTED.json"
"""Written before a stage runs: the settings an interrupted stage's checkpoints were made with."""


def marker(stage_dir: Path, name: str = MARKER) -> dict[str, Any] | None:
    path = stage_dir / name
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not JSON (a write cut off?); move {stage_dir} away to rerun that stage") from None
    if not isinstance(content, dict) or (name == MARKER and not isinstance(content.get("results"), dict)):
        what = "a JSON object" if not isinstance(content, dict) else "a 'results' object"
        raise ConfigError(f"{path} is not a marker this runner wrote (it lacks {what}); move {stage_dir} away to "
                          "rerun that stage")
    return content


def write_marker(stage_dir: Path, content: dict[str, Any], name: str = MARKER) -> None:
    """Atomically: a kill mid-write leaves the old marker or none, never half of one."""
    temporary = stage_dir / f".{name}.tmp"
    temporary.write_text(json.dumps(content, indent=2, default=str))
    os.replace(temporary, stage_dir / name)


@dataclass
class StageContext:
    """What a stage sees: its directory, the finished stages' results and a way to run recipes."""

    cfg: ReproduceConfig
    run_dir: Path
    name: str
    commands: list[list[str]] = field(default_factory=list)
    lock_fd: int | None = None
    """The run dir's lock (:mod:`~dsl_lit.reproduce.run_dir_lock`), handed to every stage it starts."""

    @property
    def dir(self) -> Path:
        return self.dir_of(self.name)

    def dir_of(self, stage: str) -> Path:
        return self.run_dir / stage

    def results(self, stage: str) -> dict[str, Any]:
        done = marker(self.dir_of(stage))
        if done is None:
            raise ConfigError(f"stage {self.name} needs stage {stage}, which has not finished in {self.run_dir}; "
                              f"run it first (reproduce.stages=[{stage},{self.name}] or null for all)")
        return done["results"]

    def recipe(self, script: str, args: Sequence[str], run_dir: Path | None = None) -> None:
        """``python recipes/<script> hydra.run.dir=<run_dir> <args> <the preset's overrides>``."""
        target = run_dir or self.dir
        self.run([str(PROJECT_ROOT / "recipes" / script), path_override("hydra.run.dir", target), *args])

    def module(self, name: str, args: Sequence[str]) -> None:
        self.run(["-m", name, *args])

    def run(self, argv: Sequence[str]) -> None:
        self.run_all([argv])

    def run_all(self, argvs: Sequence[Sequence[str]], concurrent: int = 1,
                log_paths: Sequence[Path] | None = None) -> None:
        """``python <argv> <the preset's overrides>`` for each of ``argvs``, ``concurrent`` at a time
        (each then on its share of the cores: ``OMP_NUM_THREADS`` = cores / ``concurrent``; a tiny
        model's step gains little from a second thread, so two runs on one core each finish in about
        the time of one on both). Output to ``log_paths`` (default: the stage's log). A SIGTERM or
        SIGINT reaches every running child, which saves and exits; no further one starts. A failure
        stops the others and raises :class:`StageFailed` naming its log."""
        commands = [[sys.executable, *argv, *self.cfg.overrides.get(self.name, [])] for argv in argvs]
        self.commands.extend(command[1:] for command in commands)
        self.dir.mkdir(parents=True, exist_ok=True)
        logs = list(log_paths) if log_paths is not None else [self.dir / "stage.log"] * len(commands)
        env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
        if concurrent > 1:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // concurrent))
        stop: list[int] = []
        live: dict[int, StageProcess] = {}
        failed: tuple[int, int] | None = None

        def forward(signum: int, _frame: Any) -> None:  # SIGTERM/SIGINT: the children save and exit
            stop.append(signum)
            for child in live.values():
                child.send_signal(signal.SIGTERM)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}  # before any child exists
        try:
            pending = list(range(len(commands)))
            while live or (pending and not stop and failed is None):
                while pending and len(live) < concurrent and not stop and failed is None:
                    index = pending.pop(0)
                    with logs[index].open("a") as out:
                        out.write(f"\n$ {' '.join(commands[index])}\n")
                    live[index] = start_stage(commands[index][1:], cwd=PROJECT_ROOT, env=env, log_path=logs[index],
                                              keep_fd=self.lock_fd, fork=self.cfg.device == "cpu")
                    if stop:  # signalled while it started
                        live[index].send_signal(signal.SIGTERM)
                finished = {i: code for i, child in live.items() if (code := child.poll()) is not None}
                for index, code in finished.items():
                    del live[index]
                    if code != 0 and failed is None and not stop and code not in (143, -signal.SIGTERM):
                        failed = (index, code)
                        for child in live.values():  # the others are of no use now
                            child.send_signal(signal.SIGTERM)
                    elif code in (143, -signal.SIGTERM) and failed is None:
                        stop.append(signal.SIGTERM)
                if live and not finished:
                    time.sleep(0.1)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if failed is not None:
            index, code = failed
            tail = "".join(logs[index].read_text().splitlines(keepends=True)[-15:])
            argv = commands[index][1:]
            program = argv[1] if argv[0] == "-m" else Path(argv[0]).name
            raise StageFailed(f"stage {self.name}: {program} exited {code}; log {logs[index]}:\n{tail}")
        if stop:
            raise SystemExit(143)  # stopped: no marker; the children saved their checkpoints and a rerun resumes


@dataclass(frozen=True)
class Stage:
    """A row of :data:`dsl_lit.config.reproduce_stages.STAGE_ROWS` with its work."""

    row: StageRow
    run: Callable[[StageContext], dict[str, Any]]
    """Does the work; returns the results kept in the marker (numbers for the report and later stages)."""

    @classmethod
    def from_row(cls, row: StageRow, run: Callable[[StageContext], dict[str, Any]]) -> Stage:
        return cls(row, run)

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def needs(self) -> tuple[str, ...]:
        return self.row.needs

    @property
    def description(self) -> str:
        return self.row.description

    @property
    def reads(self) -> tuple[str, ...]:
        return self.row.reads


NEW_FIELDS = ("data_build", "seed")
"""Preset fields added after runs were made: left out of the fingerprints while null, so those runs
still stand."""


def fingerprints(cfg: ReproduceConfig, stages: Sequence[Stage]) -> dict[str, str]:
    """Per stage, a hash of the settings it runs with: the preset's fields it reads, its own overrides
    and the fingerprints of the stages it reads (a changed pretraining changes every stage after it;
    a new eval_limit changes only the evaluation)."""
    fields = asdict(cfg)
    prints: dict[str, str] = {}
    for stage in stages:
        read = {key: (cfg.overrides.get(key.split(".", 1)[1], []) if key.startswith("overrides.") else fields[key])
                for key in stage.reads if not (key in NEW_FIELDS and fields[key] is None)}
        settings = [read, cfg.overrides.get(stage.name, []), [prints[n] for n in stage.needs]]
        prints[stage.name] = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return prints


def selected(cfg: ReproduceConfig, stages: Sequence[Stage], run_dir: Path) -> list[Stage]:
    """The stages this invocation runs, checked before any runs: a named subset must find the
    stages it needs finished or in the subset, and a finished stage must have run with these settings."""
    chosen = [s for s in stages if cfg.stages is None or s.name in cfg.stages]
    names = {s.name for s in chosen}
    prints = fingerprints(cfg, stages)
    for stage in chosen:
        for need in stage.needs:
            if need not in names and marker(run_dir / need) is None:
                raise ConfigError(f"reproduce.stages: stage {stage.name} needs {need}, which has not finished in "
                                  f"{run_dir}; add it to reproduce.stages")
    for stage in stages:
        if stage.row.redrawn:
            continue
        for name, state in ((MARKER, "finished"), (STARTED, "started")):
            earlier = marker(run_dir / stage.name, name)
            if earlier is not None and earlier.get("fingerprint") != prints[stage.name]:
                raise ConfigError(f"stage {stage.name} {state} in {run_dir} with other settings than "
                                  f"reproduce={cfg.name} gives now; use another run_name=, or move that directory away")
            if earlier is not None:
                break
    return chosen


def skipped(results: dict[str, Any]) -> bool:
    """A stage's results saying it did not run here (``{"skipped": why}``: lm-eval not installed)."""
    return bool(results.get("skipped"))


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def run_stages(cfg: ReproduceConfig, stages: Sequence[Stage], run_dir: Path,
               progress: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Run every selected stage not finished yet; returns each stage's results."""
    chosen = selected(cfg, stages, run_dir)
    prints = fingerprints(cfg, stages)
    lock_fd = hold_run_dir(run_dir)
    if cfg.device == "cpu":  # the stages fork from this interpreter: import what they import once
        preload()
    try:
        return _run_chosen(cfg, chosen, prints, run_dir, progress, lock_fd)
    finally:
        os.close(lock_fd)  # the stages that still hold it (none, normally) keep it until they exit


def _run_chosen(cfg: ReproduceConfig, chosen: Sequence[Stage], prints: dict[str, str], run_dir: Path,
                progress: Callable[[str], None], lock_fd: int) -> dict[str, dict[str, Any]]:
    start, spent, estimated = time.monotonic(), 0.0, 0.0
    results = {}
    for index, stage in enumerate(chosen, 1):
        stage_dir = run_dir / stage.name
        done = marker(stage_dir)
        # the report is redrawn every time, and a stage skipped for a missing package runs once it is there
        if done is not None and not stage.row.redrawn and not skipped(done["results"]):
            progress(f"stage {index}/{len(chosen)} {stage.name}: finished earlier ({_minutes(done['seconds'])}), skipped")
            results[stage.name] = done["results"]
            continue
        left = sum(cfg.estimates_s.get(s.name, 0.0) for s in chosen[index - 1:] if marker(run_dir / s.name) is None)
        pace = spent / estimated if estimated else 1.0
        progress(f"stage {index}/{len(chosen)} {stage.name}: {stage.description} (elapsed "
                 f"{_minutes(time.monotonic() - start)}, about {_minutes(left * pace)} left)")
        began = time.monotonic()
        context = StageContext(cfg, run_dir, stage.name, lock_fd=lock_fd)
        stage_dir.mkdir(parents=True, exist_ok=True)
        write_marker(stage_dir, {"stage": stage.name, "fingerprint": prints[stage.name]}, STARTED)
        stage_results = stage.run(context)
        seconds = time.monotonic() - began
        spent += seconds
        estimated += cfg.estimates_s.get(stage.name, seconds)
        write_marker(stage_dir, {"stage": stage.name, "fingerprint": prints[stage.name], "seconds": round(seconds, 1),
                                 "results": stage_results, "commands": context.commands})
        results[stage.name] = stage_results
        if skipped(stage_results):
            progress(f"stage {index}/{len(chosen)} {stage.name}: skipped: {stage_results['skipped']}")
        else:
            progress(f"stage {index}/{len(chosen)} {stage.name}: done in {_minutes(seconds)}")
    redrawn = [s.name for s in chosen if s.row.redrawn]
    report = f"; report: {run_dir / redrawn[0] / 'report.md'}" if redrawn else (
        " (no report stage in this subset: add report to reproduce.stages for one)")
    progress(f"all {len(chosen)} stages finished in {_minutes(time.monotonic() - start)}{report}")
    return results
