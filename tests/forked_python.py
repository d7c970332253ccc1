"""Recipes in real child processes without paying Python's imports each time.

Most of a tiny recipe run's wall time is importing torch, Lightning (which pulls in torchmetrics,
transformers, scipy) and friends: 5-6 s of every run, and the suite runs ~100 of them. A zygote
process imports those third-party libraries once; every run is then ``os.fork()`` of it, which
execs the recipe file with ``runpy`` as ``__main__`` with its own argv, cwd, environment, stdout
and stderr, and exits with the recipe's exit status. The run is still a separate OS process that
imports all of *our* code itself (the zygote imports no ``dsl_lit``, ``data_pipeline`` or recipe
module, so an import-order bug still shows), and the ranks Lightning launches re-execute the
recipe from its path as they would from a shell.

``run_python`` has ``subprocess.run``'s shape. It falls back to a plain subprocess when forking
is not possible: the zygote busy with a background run, or ``DSL_LIT_TESTS_NO_FORK=1``. A run
whose environment differs from the zygote's in a variable libraries read at import time
(``IMPORT_TIME_PREFIXES``) gets a new zygote started with that environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ZYGOTE = Path(__file__).with_name("_zygote.py")
# Variables the preloaded libraries read when they are imported (thread pools, devices, caches,
# backends): a run whose environment differs from the zygote's in one of these gets a fresh
# interpreter. Everything else (WANDB_*, MASTER_ADDR, RANK, ... which tests and in-process
# Trainers set) is read when a run calls for it, so the child's own environment is what counts.
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "OPENBLAS", "CUDA", "NVIDIA", "HF_",
                        "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "DATASETS", "MPL", "MATPLOTLIB",
                        "LD_", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE")

_lock = threading.Lock()
fallback_reason = ""
"""Why the last run did not fork (for tests of this module)."""
ZYGOTES_KEPT = 2
"""Zygotes kept alive, one per import-time environment, the most recently used last: a test that
runs once under another PYTHONHASHSEED or OMP_NUM_THREADS costs one new zygote, not two (the
suite's own environment keeps its zygote)."""
_zygotes: dict[tuple[tuple[str, str], ...], subprocess.Popen] = {}


def _import_time_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables read at import (``IMPORT_TIME_PREFIXES``) and their values: runs whose keys are
    equal can share a zygote."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


def _close(zygote: subprocess.Popen) -> None:
    if zygote.poll() is None:
        zygote.stdin.close()
        zygote.wait(30)


def _zygote_for(env: dict[str, str]) -> subprocess.Popen | None:
    """A zygote whose imports saw ``env``: a running one, or a new one (an import-time variable
    differs, e.g. a library set KMP_DUPLICATE_LIB_OK in this process). None if none can serve."""
    global fallback_reason
    key = _import_time_key(env)
    zygote = _zygotes.pop(key, None)
    if zygote is None or zygote.poll() is not None:
        while len(_zygotes) >= ZYGOTES_KEPT:
            _close(_zygotes.pop(next(iter(_zygotes))))  # the least recently used
        zygote = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1, env=dict(env))
        ready = zygote.stdout.readline()
        if ready.strip() != "ready":  # e.g. a library started a thread at import: fork would be unsafe
            zygote.kill()
            fallback_reason = f"zygote unavailable: {ready.strip()!r}"
            sys.stderr.write(f"[forked_python] {fallback_reason}; plain subprocesses\n")
            return None
    _zygotes[key] = zygote  # the most recently used last
    return zygote


def _forkable(args: list[str]) -> bool:
    global fallback_reason
    if os.environ.get("DSL_LIT_TESTS_NO_FORK") == "1" or not hasattr(os, "fork"):
        fallback_reason = "DSL_LIT_TESTS_NO_FORK=1 or no os.fork"
        return False
    return len(args) >= 2 and args[0] == sys.executable and args[1] != "-c"


class ForkedProcess:
    """The part of ``subprocess.Popen`` the tests use (pid, poll, wait, send_signal, returncode),
    for one child of the zygote; the zygote serves nobody else until this child has exited.
    ``ranks`` > 1: ``pid`` is the process that forked the ranks and waits for them (as torchrun's
    agent), and :meth:`rank_pids` are the ranks."""

    def __init__(self, zygote: subprocess.Popen, request: dict) -> None:
        self.args = request["argv"]
        self.ranks = int(request.get("ranks", 1))
        zygote.stdin.write(json.dumps(request) + "\n")
        self.pid = int(json.loads(zygote.stdout.readline())["pid"])
        self.returncode: int | None = None
        self._done = threading.Event()
        threading.Thread(target=self._reap, args=(zygote,), daemon=True).start()

    def _reap(self, zygote: subprocess.Popen) -> None:
        try:
            reply = zygote.stdout.readline()
            self.returncode = int(json.loads(reply)["returncode"]) if reply else -1
        finally:
            self._done.set()
            _lock.release()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if not self._done.is_set():
            os.kill(self.pid, sig)


def rank_pids(process: ForkedProcess | subprocess.Popen) -> list[int]:
    """Every rank's pid of a running recipe, by rank: the process itself and the ranks Lightning's
    launcher started from it, or the ranks the zygote forked (in the order they were forked)."""
    children = sorted(int(c) for c in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split())
    return children if getattr(process, "ranks", 1) > 1 else [process.pid, *children]


def start_python(args: list[str], *, cwd: Path | str, env: dict[str, str] | None = None, stdout: Path | str,
                 new_session: bool = False, fork_ranks: bool = True) -> ForkedProcess | subprocess.Popen:
    """``subprocess.Popen(args, cwd=cwd, env=env, stdout=<stdout file>, stderr=STDOUT,
    start_new_session=new_session)``, forked from the zygote when it is free. A run on several
    ranks gets them forked too (see :func:`run_python`) unless ``fork_ranks=False``: then rank 0
    starts the others with Lightning's launcher, the path a test of that launcher needs."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    if _forkable(args) and _lock.acquire(blocking=False):
        zygote = _zygote_for(env)
        if zygote is not None:  # the lock is released when the child exits
            Path(stdout).write_text("")  # there before this returns, as with Popen
            return ForkedProcess(zygote, {"argv": args[1:], "cwd": str(cwd), "env": env, "stdout": str(stdout),
                                          "stderr": str(stdout), "new_session": new_session,
                                          "ranks": ranks_to_fork(args) if fork_ranks else 1})
        _lock.release()
    with open(stdout, "w") as log:
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=new_session)


def ranks_to_fork(args: list[str]) -> int:
    """How many ranks a Hydra recipe run asks for on this machine (``trainer.devices=N`` on one node,
    with ``hydra.run.dir`` given so that every rank agrees on it), else 1."""
    overrides = dict(a.split("=", 1) for a in args[2:] if "=" in a and not a.startswith("-"))
    devices = overrides.get("trainer.devices", "1")
    if "hydra.run.dir" not in overrides or overrides.get("trainer.num_nodes", "1") != "1" or not devices.isdigit():
        return 1
    return int(devices)


def run_python(args: list[str], *, cwd: Path | str, env: dict[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)``
    for ``args = [sys.executable, script.py | -m module, ...]``, forked from the zygote when it is free.

    A recipe run on several ranks (``ranks_to_fork``) gets every rank forked from the zygote and
    started torchrun's way (rank and world in the environment) rather than rank 0 starting the others
    as fresh interpreters (Lightning's launcher, ~13 s of imports each here): the tests of Lightning's
    launcher itself (preemption, signals) use ``start_python``, which keeps it."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    if not (_forkable(args) and _lock.acquire(blocking=False)):
        return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    zygote = _zygote_for(env)
    if zygote is None:
        _lock.release()
        return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="forked_python_") as logs:
        out, err = Path(logs) / "stdout", Path(logs) / "stderr"
        process = ForkedProcess(zygote, {"argv": args[1:], "cwd": str(cwd), "env": env, "stdout": str(out),
                                         "stderr": str(err), "new_session": False, "ranks": ranks_to_fork(args)})
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
            raise subprocess.TimeoutExpired(args, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(args, process.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
