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

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: scripts/gpu_check.sh runs for real")
def test_gpu_check_refuses_without_a_gpu(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PY": sys.executable, "GPU_CHECK_OUT": str(tmp_path)})
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr


@pytest.mark.slow
def test_gpu_train_step_benchmark_smoke():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_train_step", "--smoke", "--models", "dense",
         "--variants", "ours bf16,ours fp8_tensorwise,transformers bf16"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = {line.split("  ")[0]: line for line in lines if line.startswith(("ours", "transformers"))}
    assert set(rows) == {"ours bf16", "ours fp8_tensorwise", "transformers bf16"}
    assert any(line.startswith("HEADLINE\tdense train step vs transformers, bf16 eager") for line in lines)
    bad = subprocess.run([sys.executable, "-m", "benchmarks.gpu_train_step", "--smoke", "--variants", "ours fp9"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "cannot read ['ours fp9']" in bad.stderr
