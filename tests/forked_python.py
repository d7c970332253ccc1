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
cannot be trusted to mean the same thing: an environment that differs from the zygote's in a
variable that libraries read at import time, or ``DSL_LIT_TESTS_NO_FORK=1``.
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
# Read when a run calls them, never when their library is imported: a request may change these.
PER_RUN_VARIABLES = ("WANDB_MODE", "WANDB_SILENT", "HYDRA_FULL_ERROR", "PYTHONPATH", "PYTEST_CURRENT_TEST",
                     "SLOW_DISK_S")  # the last: tests/test_fault_tolerance.py's slow-disk launcher

_lock = threading.Lock()
_zygote: subprocess.Popen | None = None
_zygote_env: dict[str, str] = {}


def _start_zygote() -> subprocess.Popen | None:
    global _zygote, _zygote_env
    if _zygote is not None and _zygote.poll() is None:
        return _zygote
    _zygote_env = dict(os.environ)
    _zygote = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, bufsize=1, env=_zygote_env)
    ready = _zygote.stdout.readline()
    if ready.strip() != "ready":  # e.g. a library started a thread at import: fork would be unsafe
        _zygote.kill()
        _zygote = None
        sys.stderr.write(f"[forked_python] zygote unavailable ({ready.strip()!r}); plain subprocesses\n")
    return _zygote


def _forkable(args: list[str]) -> bool:
    if os.environ.get("DSL_LIT_TESTS_NO_FORK") == "1" or not hasattr(os, "fork"):
        return False
    return len(args) >= 2 and args[0] == sys.executable and args[1] != "-c"


def _same_imports(env: dict[str, str]) -> bool:
    """Whether ``env`` agrees with the zygote's in every variable a library may read at import."""
    keys = set(env) | set(_zygote_env)
    return all(env.get(k) == _zygote_env.get(k) for k in keys if k not in PER_RUN_VARIABLES)


class ForkedProcess:
    """The part of ``subprocess.Popen`` the tests use (pid, poll, wait, send_signal, returncode),
    for one child of the zygote; the zygote serves nobody else until this child has exited."""

    def __init__(self, zygote: subprocess.Popen, request: dict) -> None:
        self.args = request["argv"]
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


def start_python(args: list[str], *, cwd: Path | str, env: dict[str, str] | None = None, stdout: Path | str,
                 new_session: bool = False) -> ForkedProcess | subprocess.Popen:
    """``subprocess.Popen(args, cwd=cwd, env=env, stdout=<stdout file>, stderr=STDOUT,
    start_new_session=new_session)``, forked from the zygote when it is free."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    if _forkable(args) and _lock.acquire(blocking=False):
        zygote = _start_zygote()
        if zygote is not None and _same_imports(env):  # the lock is released when the child exits
            Path(stdout).write_text("")  # there before this returns, as with Popen
            return ForkedProcess(zygote, {"argv": args[1:], "cwd": str(cwd), "env": env, "stdout": str(stdout),
                                          "stderr": str(stdout), "new_session": new_session})
        _lock.release()
    with open(stdout, "w") as log:
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=new_session)


def run_python(args: list[str], *, cwd: Path | str, env: dict[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)``
    for ``args = [sys.executable, script.py | -m module, ...]``, forked from the zygote when it is free."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    if not (_forkable(args) and _lock.acquire(blocking=False)):
        return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    zygote = _start_zygote()
    if zygote is None or not _same_imports(env):
        _lock.release()
        return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="forked_python_") as logs:
        out, err = Path(logs) / "stdout", Path(logs) / "stderr"
        process = ForkedProcess(zygote, {"argv": args[1:], "cwd": str(cwd), "env": env, "stdout": str(out),
                                         "stderr": str(err), "new_session": False})
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
            raise subprocess.TimeoutExpired(args, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(args, process.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
