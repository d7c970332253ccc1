"""A stage's recipe as a child process: forked from this (preloaded) interpreter where that is
safe, else a fresh ``python``.

Every stage of a CPU reproduction starts a recipe, and each fresh interpreter spent ~9 s importing
Lightning and torch before doing anything (13 stages: about two minutes of a 15-minute chain). The
runner imports them once (:func:`preload`) and forks each stage: the child takes on the stage's
working directory, environment and log, then runs the recipe as ``python <script> <args>`` would
(``runpy``, ``__main__``), and exits with its status. It is a child like any other: its own
process, signals, memory and Hydra app; it dies with the runner (``PR_SET_PDEATHSIG``) and
inherits the run directory's lock.

Forking is only safe in a process with one thread that has not touched a GPU: the runner forks
on CPU presets only (``reproduce.device=cpu``) and while it has one thread; otherwise
:func:`start_stage` starts a fresh interpreter, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from dsl_lit.reproduce.run_dir_lock import die_with_parent
from dsl_lit.utils.python_main import exit_process, run_as_main

PRELOADED = ("lightning",)
"""What every stage's recipe imports first (Lightning brings torch): ~9 s of imports each."""


class StageProcess(Protocol):
    def send_signal(self, signum: int) -> None: ...

    def poll(self) -> int | None:
        """The exit status as ``subprocess.Popen.poll`` gives it (-N: killed by signal N), None while it runs."""


def preload() -> None:
    """Import what the stages import, so that forked children start with it."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)


def can_fork() -> bool:
    return hasattr(os, "fork") and sys.platform == "linux" and threading.active_count() == 1


def start_stage(argv: Sequence[str], *, cwd: Path, env: dict[str, str], log_path: Path, keep_fd: int | None,
                fork: bool) -> StageProcess:
    """Start ``python argv...`` with stdout and stderr appended to ``log_path``; with ``fork`` (and
    one thread here) as a fork of this process."""
    if not (fork and can_fork()):
        with log_path.open("a") as out:
            return subprocess.Popen([sys.executable, *argv], cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    pass_fds=(keep_fd,) if keep_fd is not None else (),
                                    preexec_fn=die_with_parent)  # noqa: PLW1509 (no threads start stages)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 1
        try:
            _become(cwd, env, log_path)
            status = run_as_main(argv)
        finally:
            exit_process(status)
    return ForkedStage(pid)


class ForkedStage:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status: int | None = None

    def send_signal(self, signum: int) -> None:
        if self.status is None:  # never a reaped pid (the system may have given it to another process)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def poll(self) -> int | None:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status


def apply_thread_count(env: dict[str, str]) -> None:
    """``OMP_NUM_THREADS`` of a forked stage made real: torch, preloaded by the runner, read it when it
    was imported, so the variable alone changes nothing in a fork. Measured: two forked ablation runs
    meant to take one core each ran two threads each on the two cores, and the spinning threads made
    both many times slower (2 of 9 runs unfinished after 11 minutes; alone, one takes ~2)."""
    threads = env.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if threads and torch is not None:
        torch.set_num_threads(int(threads))


def _become(cwd: Path, env: dict[str, str], log_path: Path) -> None:
    """The stage's process: dies with the runner, default signal handlers, its directory,
    environment and log, none of the runner's logging or Hydra state."""
    die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    apply_thread_count(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(source, target)
    os.close(log)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    root = logging.getLogger()
    for handler in list(root.handlers):  # the runner's console and reproduce.log handlers
        root.removeHandler(handler)
    with contextlib.suppress(ImportError):
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
