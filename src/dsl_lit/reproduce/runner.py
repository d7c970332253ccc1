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
from dsl_lit.reproduce.core_slots import CoreSlots
from dsl_lit.reproduce.run_dir_lock import hold_run_dir
from dsl_lit.reproduce.stage_process import StageProcess, can_fork, fork_call, preload, start_stage

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
    slots: CoreSlots | None = None
    """The run's cores, shared with the stages running beside this one (None: this stage's own,
    ``concurrent`` of them per :meth:`run_all`)."""
    priority: int = 0
    """This stage's claim on a free slot (:func:`priorities`)."""
    owner: int = 1
    """Who this stage is to the slots (the runner numbers its stages)."""

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
        """``python <argv> <the preset's overrides>`` for each of ``argvs``, at most ``concurrent`` at
        a time, each once it holds a core slot (:class:`~dsl_lit.reproduce.core_slots.CoreSlots`: the
        run's ``reproduce.concurrent_runs`` slots, shared with the stages running beside this one) and
        on its share of the cores (``OMP_NUM_THREADS`` = cores / slots: a second thread speeds a tiny
        model's step up 1.4-1.6x, so two one-thread runs do more than one two-thread run, and every run
        gets the same thread count whatever runs beside it). Output to ``log_paths`` (default: the stage's log). A SIGTERM or SIGINT reaches every
        running child, which saves and exits; no further one starts. A failure stops the others and
        raises :class:`StageFailed` naming its log."""
        commands = [[sys.executable, *argv, *self.cfg.overrides.get(self.name, [])] for argv in argvs]
        self.commands.extend(command[1:] for command in commands)
        self.dir.mkdir(parents=True, exist_ok=True)
        logs = list(log_paths) if log_paths is not None else [self.dir / "stage.log"] * len(commands)
        env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
        slots = self.slots or CoreSlots(concurrent)
        threads = slots.threads()
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
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
                while (pending and len(live) < concurrent and not stop and failed is None
                       and (len(live) < slots.held(self.owner) or slots.try_take(self.owner, self.priority))):
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
                    more = pending and not stop and failed is None
                    if (live and not more) or (more and slots.outranked(self.priority)):
                        # not needed until the others end, or wanted more elsewhere; the last one's slot
                        # stays for what this stage does next (the runner takes it back when it ends)
                        slots.give_back(self.owner)
                    if code != 0 and failed is None and not stop and code not in (143, -signal.SIGTERM):
                        failed = (index, code)
                        for child in live.values():  # the others are of no use now
                            child.send_signal(signal.SIGTERM)
                    elif code in (143, -signal.SIGTERM) and failed is None:
                        stop.append(signal.SIGTERM)
                if not finished:
                    time.sleep(0.1)
        finally:
            slots.withdraw(self.owner)
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


def priorities(stages: Sequence[Stage]) -> dict[str, int]:
    """Each stage's claim on a free core slot: the length of the longest chain of stages that wait on
    it (the pretraining's, through the R1 stages to the evaluation, is the longest), so that chain
    never queues behind the runs of a stage nothing waits on (the ablations)."""
    names = {s.name for s in stages}
    rank: dict[str, int] = {}
    for stage in reversed(stages):  # the rows are in an order where every stage follows what it needs
        waiting = [rank[s.name] for s in stages if stage.name in s.needs and s.name in rank]
        rank[stage.name] = 1 + max(waiting) if waiting else 0
    return {name: r for name, r in rank.items() if name in names}


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


@dataclass
class _Running:
    """A stage running in a process of its own."""

    process: StageProcess
    failure: int
    """The read end of the pipe its failure message comes through."""


CONFIG_EXIT = 2
"""A stage process's status when its stage raised ConfigError (a recipe's own exit 2 is a StageFailed)."""
FAILURE_BYTES = 16384
"""At most this much of a failure's message comes back (a pipe holds it without blocking the stage)."""


def _run_stage(stage: Stage, context: StageContext, fingerprint: str) -> None:
    """One stage's work and its markers: STARTED (the settings its checkpoints are made with), then
    DONE with its results, its seconds and its recipes' commands."""
    stage_dir = context.dir
    stage_dir.mkdir(parents=True, exist_ok=True)
    write_marker(stage_dir, {"stage": stage.name, "fingerprint": fingerprint}, STARTED)
    began, began_at = time.monotonic(), time.time()
    stage_results = stage.run(context)
    write_marker(stage_dir, {"stage": stage.name, "fingerprint": fingerprint,
                             "seconds": round(time.monotonic() - began, 1), "started_at": round(began_at, 1),
                             "finished_at": round(time.time(), 1), "results": stage_results,
                             "commands": context.commands})


class _Finished:
    """A stage that ran in this process: its status, as a finished process's."""

    def __init__(self, status: int) -> None:
        self.status = status

    def send_signal(self, signum: int) -> None:
        pass

    def poll(self) -> int | None:
        return self.status


def _start(stage: Stage, context: StageContext, fingerprint: str, slots: CoreSlots) -> _Running:
    """The stage in a fork of this process (one thread here), else run here to its end; either way
    its claim on a core slot registered first."""
    slots.claim(context.owner, context.priority)
    read, write = os.pipe()
    os.set_blocking(read, False)  # read once it has exited: what its message left, never a wait
    if not can_fork():
        os.close(write)
        try:
            _run_stage(stage, context, fingerprint)
        except BaseException:
            os.close(read)
            raise
        finally:
            slots.reclaim(context.owner)  # it has ended: the next stage, here, takes its slot
        return _Running(_Finished(0), read)

    def body() -> int:
        os.close(read)
        stopped = signal.SIGTERM, signal.SIGINT  # between runs: exit; during one, run_all forwards it first

        def end(_signum: int, _frame: Any) -> None:
            raise SystemExit(143)

        for signum in stopped:
            signal.signal(signum, end)
        status, message = 0, ""
        try:
            _run_stage(stage, context, fingerprint)
        except (StageFailed, ConfigError) as error:
            status, message = (CONFIG_EXIT if isinstance(error, ConfigError) else 1), str(error)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException as error:  # a bug in the stage's own code: its traceback in the stage's log
            import traceback

            with (context.dir / "stage.log").open("a") as out:
                traceback.print_exc(file=out)
            status, message = 1, f"stage {stage.name}: {type(error).__name__}: {error} (traceback in {context.dir / 'stage.log'})"
        os.write(write, message.encode()[:FAILURE_BYTES])
        os.close(write)
        return status

    process = fork_call(body)
    os.close(write)
    return _Running(process, read)


def _read_failure(fd: int) -> str:
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:  # a run it started still holds the pipe open: the message is in already
        pass
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def _run_chosen(cfg: ReproduceConfig, chosen: Sequence[Stage], prints: dict[str, str], run_dir: Path,
                progress: Callable[[str], None], lock_fd: int) -> dict[str, dict[str, Any]]:
    """Every stage starts, in a process of its own, once the stages it needs have finished (the
    report once every other has), so independent stages overlap; their recipe runs share
    ``reproduce.concurrent_runs`` core slots. Where this process cannot fork, one stage at a time
    runs in it, in the rows' order. A stage's numbers do not depend on what runs beside it: every
    run has its own process and the same thread count whatever overlaps it."""
    start, spent, estimated = time.monotonic(), 0.0, 0.0
    slots, ranks = CoreSlots(cfg.concurrent_runs), priorities(chosen)
    number = {stage.name: index for index, stage in enumerate(chosen, 1)}
    results: dict[str, dict[str, Any]] = {}
    todo: list[Stage] = []
    for stage in chosen:
        done = marker(run_dir / stage.name)
        # the report is redrawn every time, and a stage skipped for a missing package runs once it is there
        if done is not None and not stage.row.redrawn and not skipped(done["results"]):
            progress(f"stage {number[stage.name]}/{len(chosen)} {stage.name}: finished earlier "
                     f"({_minutes(done['seconds'])}), skipped")
            results[stage.name] = done["results"]
        else:
            todo.append(stage)
    running: dict[str, _Running] = {}
    stop: list[int] = []
    failed: tuple[str, str] | None = None
    failed_config = False

    def forward(signum: int, _frame: Any) -> None:  # SIGTERM/SIGINT: every stage saves and exits
        stop.append(signum)
        for entry in running.values():
            entry.process.send_signal(signal.SIGTERM)

    def ready(stage: Stage) -> bool:
        if stage.row.redrawn:
            return len(todo) == 1 and not running
        return all(need in results or marker(run_dir / need) is not None for need in stage.needs)

    ended: list[int] = []  # the stages that ended since the last look: their slots come back
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while (todo and not stop and failed is None) or running:
            startable = [s for s in todo if ready(s)] if not stop and failed is None else []
            if todo and not startable and not running and not stop and failed is None:  # selected() rules it out
                raise ConfigError(f"reproduce: stages {', '.join(s.name for s in todo)} wait on stages that never ran")
            for stage in startable:  # each registers its claim on a slot before the ended stages' slots come back
                left = sum(cfg.estimates_s.get(s.name, 0.0) for s in todo) / max(1, min(cfg.concurrent_runs, len(todo)))
                pace = spent / estimated if estimated else 1.0
                progress(f"stage {number[stage.name]}/{len(chosen)} {stage.name}: {stage.description} (elapsed "
                         f"{_minutes(time.monotonic() - start)}, about {_minutes(left * pace)} left)")
                todo.remove(stage)
                context = StageContext(cfg, run_dir, stage.name, lock_fd=lock_fd, slots=slots, priority=ranks[stage.name],
                                       owner=number[stage.name])
                running[stage.name] = _start(stage, context, prints[stage.name], slots)
            for owner in ended:
                slots.reclaim(owner)
            ended = []
            for name, entry in list(running.items()):
                code = entry.process.poll()
                if code is None:
                    continue
                del running[name]
                ended.append(number[name])
                message = _read_failure(entry.failure)
                if code == 0:
                    done = marker(run_dir / name)
                    if done is None:
                        failed = failed or (name, f"stage {name} ended without its marker")
                        continue
                    results[name] = done["results"]
                    spent += done["seconds"]
                    estimated += cfg.estimates_s.get(name, done["seconds"])
                    if skipped(done["results"]):
                        progress(f"stage {number[name]}/{len(chosen)} {name}: skipped: {done['results']['skipped']}")
                    else:
                        progress(f"stage {number[name]}/{len(chosen)} {name}: done in {_minutes(done['seconds'])}")
                elif code in (143, -signal.SIGTERM) or stop:
                    stop.append(signal.SIGTERM)
                    for other in running.values():
                        other.process.send_signal(signal.SIGTERM)
                elif failed is None:
                    failed, failed_config = (name, message or f"stage {name} exited {code}"), code == CONFIG_EXIT
                    for other in running.values():  # the others are of no use now: they save and exit
                        other.process.send_signal(signal.SIGTERM)
            if running:
                time.sleep(0.1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failed is not None:
        name, message = failed
        raise (ConfigError if failed_config else StageFailed)(message)
    if stop:
        raise SystemExit(143)  # stopped: no marker; the stages' runs saved their checkpoints and a rerun resumes
    redrawn = [s.name for s in chosen if s.row.redrawn]
    report = f"; report: {run_dir / redrawn[0] / 'report.md'}" if redrawn else (
        " (no report stage in this subset: add report to reproduce.stages for one)")
    progress(f"all {len(chosen)} stages finished in {_minutes(time.monotonic() - start)}{report}")
    return results
