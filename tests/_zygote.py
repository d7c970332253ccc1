"""The fork server of tests/forked_python.py: imports the heavy third-party libraries once, then
forks one child per request line on stdin and answers its pid and exit status on stdout.

Only third-party libraries are imported here (each child runs as ``python`` would through
``src/dsl_lit/utils/python_main.py``, loaded by path: the package itself is not imported), and no
torch operation runs, so no thread pool exists when we fork (checked: a second thread makes this
refuse to serve)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import signal
import socket
import sys
import threading
import time


def _python_main():  # noqa: ANN202
    """``src/dsl_lit/utils/python_main.py`` (standard library only) loaded by path, under a private
    name: nothing of the package is imported before the recipe a child runs (it may be another tree's)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src", "dsl_lit", "utils", "python_main.py")
    spec = importlib.util.spec_from_file_location("_zygote_python_main", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_main = _python_main()
exit_process, run_as_main = _main.exit_process, _main.run_as_main

PRELOAD = ("numpy", "torch", "lightning", "hydra", "omegaconf", "transformers", "datasets", "tokenizers",
           "safetensors", "matplotlib.pyplot")
# Not preloaded: libraries whose import creates state on disk that the first child's exit would
# remove under the others (wandb makes its media directory at import and deletes it at exit).
NOT_PRELOADED = ("wandb",)

GANG_GRACE_S = 10  # after one rank failed, before the others are killed


def _become(request: dict) -> None:
    """Take on the run's working directory, environment, session and output files."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("new_session"):
        os.setsid()  # its own process group, as Popen(start_new_session=True): killpg reaches its ranks
    opened: dict[str, int] = {}
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        if path not in opened:
            opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened[path], fd)
    for target in opened.values():
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _run(argv: list[str]) -> int:
    """``python argv...`` in this process (whose environment is the run's): its exit status."""
    return run_as_main(argv, [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


_exit = exit_process


def _child(request: dict) -> None:
    """Become ``python argv...`` in ``cwd`` with ``env``; never returns."""
    status = 1
    try:
        _become(request)
        status = _run(request["argv"])
    finally:
        _exit(status)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_argv(argv: list[str], rank: int) -> list[str]:
    """What Lightning's launcher gives the rank it starts for a Hydra recipe (its own job name, no
    second ``.hydra/`` directory); rank 0 runs as the user started it."""
    return argv if rank == 0 else [*argv, f"hydra.job.name=train_ddp_process_{rank}", "hydra.output_subdir=null"]


def _gang(request: dict) -> None:
    """Start ``request["ranks"]`` ranks of one run as forks of this process, as torchrun does with
    its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT in their environment), and exit with
    the first failing rank's status once all have exited; never returns.

    A failing rank gets the others a SIGTERM (then SIGKILL after ``GANG_GRACE_S``), a SIGTERM or
    SIGINT to this process reaches every rank, and ranks die with this process (PR_SET_PDEATHSIG)."""
    status = 1
    try:
        _become(request)
        world = int(request["ranks"])
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
                           "NODE_RANK": "0", "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": str(world)})
        ranks: dict[int, int] = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                rank_status = 1
                try:
                    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
                    rank_status = _run(_rank_argv(request["argv"], rank))
                finally:
                    _exit(rank_status)
            ranks[pid] = rank

        def forward(signum: int, _frame: object) -> None:
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        failed: int | None = None
        deadline: float | None = None
        while ranks:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if deadline is not None and time.monotonic() > deadline:
                    forward(signal.SIGKILL, None)
                    deadline = None
                time.sleep(0.05)
                continue
            if pid not in ranks:
                continue
            del ranks[pid]
            code = os.waitstatus_to_exitcode(wait_status)
            code = 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N
            if code != 0 and failed is None:
                failed = code
                forward(signal.SIGTERM, None)
                deadline = time.monotonic() + GANG_GRACE_S
        status = failed or 0
    finally:
        os._exit(status)


def preloadable(names: tuple[str, ...] = PRELOAD) -> list[str]:
    """The libraries of ``names`` that are installed: an image without ``datasets`` (a GPU node with
    no package access) still gets a zygote, with the rest preloaded, instead of one that fails at
    start-up before every run falls back to a fresh interpreter."""
    return [name for name in names if _installed(name.split(".")[0])]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def main() -> None:
    for name in preloadable():
        importlib.import_module(name)
    if threading.active_count() != 1:
        print(f"threads after import: {[t.name for t in threading.enumerate()]}", flush=True)
        return
    if any(name in sys.modules for name in NOT_PRELOADED):
        print(f"one of {NOT_PRELOADED} was imported by {PRELOAD}", flush=True)
        return
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            if request.get("ranks", 1) > 1:
                _gang(request)
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, wait_status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(wait_status)}), flush=True)


if __name__ == "__main__":
    main()
