"""The real recipe, end to end, in a subprocess: training lowers the loss, every metric is logged,
checkpoints are written as step directories holding the whole training state, W&B runs offline."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from dsl_lit.checkpoint.sharded import read_full_tensors
from tests.recipe_runs import losses, run_recipe


@pytest.mark.slow
def test_train_log_and_checkpoint(tmp_path):
    """Exact resume (also after SIGKILL or SIGTERM) is checked in tests/e2e/recipes/test_fault_tolerance.py."""
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


@pytest.mark.slow
def test_a_bf16_run_resumed_mid_run_continues_exactly(tmp_path):
    """The CPU twin of the GPU resume test: bf16 autocast (the routed experts' bf16 weight copies on),
    the default optimizer (torch's fused AdamW), a step-2 checkpoint resumed in a new run dir: steps
    2-3 equal the uninterrupted run's bit for bit (CPU kernels are deterministic). Stale expert copies
    (a fused step that left the weights' versions alone) made the resumed run differ at once (at step
    4 of 8: 7.5852 vs 7.5838). Few steps: a CPU without native bf16 emulates its GEMMs (~15x slower)."""
    import shutil

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = ("trainer.max_steps=4", "checkpoint.every_n_steps=2", "precision=bf16", "logger=csv",
            "trainer.peak_tflops=null")
    run_recipe(full, *args)
    shutil.copytree(full / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    run_recipe(resumed, *args)
    reference, after = losses(full), losses(resumed)
    assert sorted(after) == [2, 3]
    assert {step: after[step] for step in after} == {step: reference[step] for step in after}
