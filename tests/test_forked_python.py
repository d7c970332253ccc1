"""The fork server the end-to-end tests run recipes through behaves like ``subprocess.run``: exit
status, output, working directory, environment, argv, ``-m`` modules, timeouts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked_python import run_python

SCRIPT = """
import os, sys
print("out", os.getcwd(), os.environ.get("WANDB_MODE"), *sys.argv, sep="|")
print("err", __name__, "dsl_lit" in sys.modules, sep="|", file=sys.stderr)
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
    env = {**os.environ, "WANDB_MODE": "disabled-for-this-run"}
    result = runner([sys.executable, str(script), "3"], cwd=tmp_path, env=env, **kwargs)
    assert result.returncode == 3
    assert result.stdout == f"out|{tmp_path}|disabled-for-this-run|{script}|3\n"
    # the recipe runs as __main__, and nothing of ours is imported before it
    assert result.stderr == "err|__main__|False\n"
    assert runner([sys.executable, str(script)], cwd=tmp_path, **kwargs).returncode == 0


def test_a_module_an_exception_and_a_timeout(script: Path, tmp_path: Path) -> None:
    result = run_python([sys.executable, "-m", "script", "x"], cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.endswith("|x\n")
    (tmp_path / "boom.py").write_text("raise ValueError('boom')\n")
    failed = run_python([sys.executable, str(tmp_path / "boom.py")], cwd=tmp_path)
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: boom")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([sys.executable, str(script), "sleep"], cwd=tmp_path, timeout=2)
    assert run_python([sys.executable, str(script), "5"], cwd=tmp_path).returncode == 5  # still serving
