"""The real recipe, end to end, in a subprocess: training lowers the loss, every metric is logged,
checkpoints are written as step directories holding the whole training state, W&B runs offline."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsl_lit.checkpoint.sharded import read_full_tensors
from tests.conftest import ROOT
from tests.forked_python import run_python

SMALL = [
    "+model.n_layers=2", "data.seq_len=64", "data.global_batch_size=8", "data.micro_batch_size=4",
    "optim.lr=3e-3", "schedule.warmup_steps=2", "schedule.total_steps=12", "trainer.progress_bar=false", "trainer.log_every_n_steps=1",
    # MFU's denominator given: measuring it takes ~1 s per rank per run (test_train_log_and_checkpoint measures)
    "trainer.peak_tflops=1.0",
    # CSV only: a W&B offline run costs ~2 CPU-s a run (its import and service), and the suite runs
    # ~100; test_train_log_and_checkpoint runs the default loggers (W&B + CSV) and checks W&B's files
    "logger=csv",
]


def run_recipe(run_dir: Path, *overrides: str, succeed: bool | None = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """The pretrain recipe in a subprocess, killed after ``timeout`` s; asserts it exits 0
    (``succeed=False``: that it does not; None: no assertion)."""
    result = run_python(
        [sys.executable, str(ROOT / "recipes" / "pretrain.py"), *SMALL, f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT, timeout=timeout, env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    if succeed is not None:
        assert (result.returncode == 0) == succeed, result.stderr[-3000:]
    return result


def metric(run_dir: Path, key: str) -> dict[int, str]:
    """``key`` per step from the run's metrics.csv (as written, so equality is bit for bit)."""
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): r[key] for r in csv.DictReader(f) if r.get(key)}


def losses(run_dir: Path) -> dict[int, str]:
    return metric(run_dir, "train/loss")


@pytest.mark.slow
def test_train_log_and_checkpoint(tmp_path):
    """Exact resume (also after SIGKILL or SIGTERM) is checked in tests/test_fault_tolerance.py."""
    full = tmp_path / "full"
    # default model deepseek_v3_tiny (2 layers: dense, MoE; one MTP module); default logger W&B + CSV
    run_recipe(full, "trainer.max_steps=12", "checkpoint.every_n_steps=4", "logger=wandb",
               "logger.expert_load_every_n_steps=4", "trainer.peak_tflops=null")  # the demo's defaults: W&B + CSV, MFU against a measured GEMM
    full_losses = losses(full)
    assert sorted(full_losses) == list(range(12))
    assert float(full_losses[11]) < float(full_losses[0]) - 1.0

    ckpts = sorted(p.name for p in (full / "checkpoints").iterdir())
    assert ckpts == ["step-12", "step-4", "step-8"]
    step12 = full / "checkpoints" / "step-12"
    assert json.loads((step12 / "meta.json").read_text())["global_step"] == 12
    state = torch.load(step12 / "trainer_state.pt", weights_only=True)
    assert state["PretrainDataModule"]["consumed_samples"] == 12 * 8
    weights = read_full_tensors(step12 / "shards", prefix="state_dict/")
    assert "model.layers.1.attention.wkv_a.weight" in weights and "model.layers.2.attention.wkv_a.weight" not in weights
    bias = weights["model.layers.1.feed_forward.gate.expert_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # the balancing bias moved and was saved
    assert "model.mtp.0.eh_proj.weight" in weights
    assert (step12 / "config.yaml").read_text().count("global_batch_size: 8") == 1
    assert (full / "resolved_config.yaml").is_file() and (full / ".hydra" / "config.yaml").is_file()
    assert list((full / "wandb").glob("offline-run-*")), "W&B offline run missing"
    with (full / "metrics.csv").open() as f:
        header = next(csv.reader(f))
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/tokens_seen", "perf/mfu",
                "train/mtp_loss", "train/mtp_weight", "train/balance_loss", "moe/load_max_over_mean",
                "moe/load_max_over_mean/layers.1", "moe/load_max_over_mean/mtp.0", "moe/bias_abs_mean"):
        assert key in header
    heatmaps = list((full / "wandb").glob("offline-run-*/files/media/images/moe/expert_load_*.png"))
    assert len(heatmaps) == 3, heatmaps  # steps 4, 8 and 12
