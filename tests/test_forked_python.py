"""The fork server the end-to-end tests run recipes through behaves like ``subprocess.run``: exit
status, output, working directory, environment, argv, ``-m`` modules, timeouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forked_python
from tests.forked_python import ForkedProcess, run_python, start_python

SCRIPT = """
import os, sys
print("out", os.getcwd(), os.environ.get("WANDB_MODE"), *sys.argv, sep="|")
print("err", __name__, "dsl_lit" in sys.modules, "torch" in sys.modules, sep="|", file=sys.stderr)
if sys.argv[1:] == ["sleep"]:
    import time; time.sleep(60)
raise SystemExit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else None)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("runner", [run_python, subprocess.run])
def test_like_a_subprocess(script: Path, tmp_path: Path, runner) -> None:
    kwargs = {"capture_output": True, "text": True} if runner is subprocess.run else {}
    # MASTER_ADDR: what in-process Trainers leave behind; read at run time, so the run still forks
    env = {**os.environ, "WANDB_MODE": "disabled-for-this-run", "MASTER_ADDR": "127.0.0.2"}
    result = runner([sys.executable, str(script), "3"], cwd=tmp_path, env=env, **kwargs)
    assert result.returncode == 3
    assert result.stdout == f"out|{tmp_path}|disabled-for-this-run|{script}|3\n"
    # the recipe runs as __main__, nothing of ours is imported before it, torch only in a fork
    assert result.stderr == f"err|__main__|False|{runner is run_python}\n", forked_python.fallback_reason
    assert runner([sys.executable, str(script)], cwd=tmp_path, **kwargs).returncode == 0


def test_a_variable_read_at_import_reaches_the_imports(tmp_path: Path) -> None:
    """OMP_NUM_THREADS sizes torch's thread pool when torch is imported: the run gets a zygote
    that imported torch under it."""
    (tmp_path / "threads.py").write_text("import torch\nprint(torch.get_num_threads())\n")
    one = run_python([sys.executable, str(tmp_path / "threads.py")], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert one.returncode == 0 and int(one.stdout) == 1, one.stderr
    default = run_python([sys.executable, str(tmp_path / "threads.py")], cwd=tmp_path)
    assert default.returncode == 0 and int(default.stdout) >= 1, default.stderr  # the zygote is back


def test_a_module_an_exception_and_a_timeout(script: Path, tmp_path: Path) -> None:
    result = run_python([sys.executable, "-m", "script", "x"], cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.endswith("|x\n")
    (tmp_path / "boom.py").write_text("raise ValueError('boom')\n")
    failed = run_python([sys.executable, str(tmp_path / "boom.py")], cwd=tmp_path)
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: boom")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([sys.executable, str(script), "sleep"], cwd=tmp_path, timeout=2)
    assert run_python([sys.executable, str(script), "5"], cwd=tmp_path).returncode == 5  # still serving


def test_a_background_run_in_its_own_session_takes_signals(script: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    process = start_python([sys.executable, str(script), "sleep"], cwd=tmp_path, stdout=log, new_session=True)
    assert isinstance(process, ForkedProcess), forked_python.fallback_reason
    deadline = time.monotonic() + 30
    while "out|" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    assert os.getpgid(process.pid) == process.pid  # os.killpg(process.pid) reaches what it started
    # while it runs, the zygote is busy: other runs fall back to plain subprocesses
    assert run_python([sys.executable, str(script), "4"], cwd=tmp_path).returncode == 4
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    assert log.read_text().startswith("out|") and "err|__main__" in log.read_text()  # both streams
