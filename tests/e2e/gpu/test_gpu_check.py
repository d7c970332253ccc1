"""scripts/gpu_check.sh and its benchmark, where no GPU is: the script refuses at once with the
reason (exit 2) rather than reporting skipped tests as a check; the benchmark's table and
headlines come out of its smoke mode (toy shapes, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.forked_python import run_python

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: scripts/gpu_check.sh runs for real")
def test_gpu_check_refuses_without_a_gpu(tmp_path):
    """The dry run on CPU: one line, exit 2, before any part runs (nothing written but the folder)."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_OUT"}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**env, "PY": sys.executable, "OUT": str(tmp_path / "out")})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"scripts/gpu_check.sh: needs a CUDA GPU (torch.cuda.is_available() is False with {sys.executable}): "
        "run it on the GPU machine"]
    assert (tmp_path / "out").is_dir() and not any((tmp_path / "out").iterdir())  # the caller's $OUT


def test_gpu_check_summary_reports_every_test_and_figure(tmp_path):
    """The summary table from what the parts left: a test collected but never reported is a timeout,
    a failure keeps its first error line, each benchmark headline is a row."""
    (tmp_path / "device.txt").write_text("device: NVIDIA H200 (sm90), torch 2.11.0+cu130, CUDA 13.0\ntorchao 0.18.0\n")
    (tmp_path / "parts.tsv").write_text("recipe GPU tests\ttimeout\t140\ntrain-step benchmark\tpassed\t98\n")
    (tmp_path / "collected.txt").write_text("tests/e2e/gpu/test_gpu.py::test_a\ntests/e2e/gpu/test_gpu.py::test_b[x]\ntests/e2e/gpu/test_gpu.py::test_c\n")
    (tmp_path / "tests.tsv").write_text("tests/e2e/gpu/test_gpu.py::test_a\tpassed\t12\t\n"
                                        "tests/e2e/gpu/test_gpu.py::test_b[x]\tfailed\t30\tAssertionError: loss 9.1 vs 6.5\n")
    headline = "HEADLINE\tdense MFU, bf16 + compile\t50.4\t%\t>= 55%\n"
    (tmp_path / "gpu_train_step.log").write_text("ours bf16  99.4\n" + headline)
    (tmp_path / "check.log").write_text("== train-step benchmark\n" + headline)  # a caller's tee of the whole check
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "- device: NVIDIA H200 (sm90), torch 2.11.0+cu130, CUDA 13.0" in text and "- torchao 0.18.0" in text
    assert "| recipe GPU tests | timeout | 140 |" in text
    assert "| test_a | passed | 12 | - |" in text
    assert "| test_b[x] | failed | 30 | AssertionError: loss 9.1 vs 6.5 |" in text
    assert "| test_c | timeout | - | not reached before its part's deadline |" in text
    assert "tests: 1 failed, 1 passed, 1 timeout" in text
    assert text.count("| dense MFU, bf16 + compile | 50.4 % | >= 55% |") == 1


def test_the_checks_pytest_runs_record_what_they_selected_and_each_outcome(tmp_path):
    """The check's own pytest command line (``-v``, pytest-xdist workers) on CPU: every selected test's
    id lands in collected.txt (once per worker) and its outcome in tests.tsv, so the summary names
    each one. (A separate ``--collect-only -q`` after ``-v`` printed pytest's tree, no ids: the H200
    check of session 35 reported no test it had not reached.)"""
    # run from the suite (itself maybe an xdist worker, writing a --junitxml report): a pytest of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(DSL_LIT_TEST_COLLECTED=str(tmp_path / "collected.txt"), DSL_LIT_TEST_RESULTS=str(tmp_path / "tests.tsv"))
    result = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
                             "tests/e2e/gpu/test_gpu.py", "-m", "gpu and exclusive and not gpu_long", "-n", "2"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:]
    wanted = ["tests/e2e/gpu/test_gpu.py::test_torchao_modules_are_installed",
              "tests/e2e/gpu/test_gpu.py::test_training_step_has_no_host_sync[bf16]"]
    assert sorted(set((tmp_path / "collected.txt").read_text().splitlines())) == sorted(wanted)
    text = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    for name in wanted:
        assert text.count(f"| {name.split('::')[1]} | skipped |") == 1, text
    assert "tests: 2 skipped" in text


def test_the_benchmarks_floors_catch_a_slow_path(capsys):
    """The check's speed floors on rows as an H200 measured them (2026-11-29: dense bf16 + compile
    98.6 ms, fp8_tensorwise + compile 89.7 ms; MoE bf16 eager 77.8 ms): every floor holds; a dense
    step at 40% of the MFU, an FP8 step at 1.2x bf16's or experts at half the MoE's speed each fail
    their floor, named, and nothing is reported before its rows exist."""
    from benchmarks.gpu_train_step import FLOORS, Result, check_floors

    def rows(dense_s: float, fp8_s: float, moe_s: float) -> dict:
        return {"dense": {"ours bf16 compile": Result(2.0, dense_s, 0), "ours fp8_tensorwise compile": Result(15.0, fp8_s, 0)},
                "moe": {"ours bf16": Result(1.0, moe_s, 0)}}

    reported: set[str] = set()
    assert check_floors(rows(0.0986, 0.0897, 0.0778), 2048, 4 * 2048, 989.0, False, reported) == []
    assert reported == {floor.what for floor in FLOORS}
    assert capsys.readouterr().out.count(": ok\n") == 3
    failed = check_floors(rows(0.0986 * 50.9 / 39.0, 0.0986 * 50.9 / 39.0 * 1.2, 0.0778 * 2), 2048, 4 * 2048, 989.0,
                          False, set())
    assert [line.split(":")[0] for line in failed] == [floor.what for floor in FLOORS]
    assert capsys.readouterr().out.count(": FAILED\n") == 3
    assert check_floors({"dense": {"ours bf16 compile": Result(2.0, 0.0986, 0)}}, 2048, 8192, None, False, set()) == []
    assert capsys.readouterr().out == ""  # no peak, no MFU; no FP8 row, no ratio


@pytest.mark.slow
def test_gpu_train_step_benchmark_smoke():
    result = run_python(  # forked from the tests' zygote: torch and transformers imported once
        [sys.executable, "-m", "benchmarks.gpu_train_step", "--smoke", "--models", "dense",
         "--variants", "ours bf16,ours fp8_tensorwise,transformers bf16"],
        cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = {line.split("  ")[0]: line for line in lines if line.startswith(("ours", "transformers"))}
    assert set(rows) == {"ours bf16", "ours fp8_tensorwise", "transformers bf16"}
    assert any(line.startswith("HEADLINE\tdense train step vs transformers, bf16 eager") for line in lines)
    bad = run_python([sys.executable, "-m", "benchmarks.gpu_train_step", "--smoke", "--variants", "ours fp9"],
                     cwd=ROOT, timeout=120)
    assert bad.returncode != 0 and "cannot read ['ours fp9']" in bad.stderr
