"""The fork server of tests/forked_python.py: imports the heavy third-party libraries once, then
forks one child per request line on stdin and answers its pid and exit status on stdout.

Only third-party libraries are imported here, and no torch operation runs, so no thread pool
exists when we fork (checked: a second thread makes this refuse to serve)."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import sys
import threading
import traceback

PRELOAD = ("numpy", "torch", "lightning", "hydra", "omegaconf", "transformers", "datasets", "tokenizers",
           "safetensors", "matplotlib.pyplot")
# Not preloaded: libraries whose import creates state on disk that the first child's exit would
# remove under the others (wandb makes its media directory at import and deletes it at exit).
NOT_PRELOADED = ("wandb",)


def _exit_status(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """Become ``python argv...`` in ``cwd`` with ``env``; never returns."""
    status = 1
    try:
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
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[:1] = [os.getcwd(), *extra]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as error:
        status = _exit_status(error)
    except BaseException:  # noqa: BLE001 (the recipe's own traceback, as python would print it)
        traceback.print_exc()
        status = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def main() -> None:
    for name in PRELOAD:
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
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, wait_status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(wait_status)}), flush=True)


if __name__ == "__main__":
    main()
