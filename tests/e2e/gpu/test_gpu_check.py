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
