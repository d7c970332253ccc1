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
    threads = "2" if os.environ.get("OMP_NUM_THREADS") == "1" else "1"  # not the suite's own (make test: 1)
    one = run_python([sys.executable, str(tmp_path / "threads.py")], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": threads})
    assert one.returncode == 0 and int(one.stdout) == int(threads), one.stderr
    default = run_python([sys.executable, str(tmp_path / "threads.py")], cwd=tmp_path)
    assert default.returncode == 0 and int(default.stdout) >= 1, default.stderr  # the suite's zygote, still there


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


RANK_SCRIPT = """
import os, sys
rank = int(os.environ["RANK"])
print(rank, os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"], sys.argv[-1], flush=True)
raise SystemExit(5 if sys.argv[1] == "fail" and rank == 1 else 0)
"""


def test_a_run_on_several_ranks_forks_each_rank_torchrun_s_way(tmp_path: Path) -> None:
    """``trainer.devices=N`` with ``hydra.run.dir``: N ranks with their rank, one rendezvous port,
    Lightning's per-rank Hydra arguments, and the first failing rank's exit status."""
    (tmp_path / "ranks.py").write_text(RANK_SCRIPT)
    args = [sys.executable, str(tmp_path / "ranks.py"), "ok", "trainer.devices=3", f"hydra.run.dir={tmp_path}"]
    assert forked_python.ranks_to_fork(args) == 3
    result = run_python(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = sorted(line.split() for line in result.stdout.splitlines())
    assert [line[:3] for line in lines] == [["0", "0", "3"], ["1", "1", "3"], ["2", "2", "3"]]
    assert len({line[3] for line in lines}) == 1  # one MASTER_PORT
    assert [line[4] for line in lines] == [f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null", "hydra.output_subdir=null"]
    failed = run_python([*args[:2], "fail", *args[3:]], cwd=tmp_path)
    assert failed.returncode == 5, failed.stderr
    # without hydra.run.dir the ranks could not agree on their run directory: one process
    assert forked_python.ranks_to_fork(args[:-1]) == 1


BLOCK_DATASETS = """import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name == "datasets" or name.startswith("datasets."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _Missing())
"""


def test_the_zygote_starts_where_a_preloaded_library_is_missing(tmp_path: Path) -> None:
    """A GPU image without ``datasets``: the zygote preloads the rest and serves, rather than failing
    at start-up and leaving every run to a fresh interpreter."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_DATASETS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    zygote = subprocess.Popen([sys.executable, str(forked_python.ZYGOTE)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert zygote.stdout.readline().strip() == "ready"
    finally:
        zygote.stdin.close()
        zygote.wait(60)
