"""DPO: the objective through the module (reference log-probs cached vs a frozen reference model),
and the R1-style pipeline through the real recipes: SFT writes a checkpoint, DPO starts from it,
its loss falls and the chosen-vs-rejected margin rises (Lightning, Hydra, W&B offline, metrics.csv)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsl_lit.data.arithmetic import TaskConfig
from dsl_lit.data.preference import collate_pairs, preference_rows, task_pairs
from dsl_lit.models import ModelConfig
from dsl_lit.modules import DPOModule
from dsl_lit.optim import OptimConfig, ScheduleConfig
from dsl_lit.posttrain_config import DPOConfig
from tests.conftest import ROOT
from tests.test_pretrain_e2e import metric
from tests.test_sft import tokenizer  # noqa: F401  (fixture)


def test_pairs_are_interleaved_and_masked(tokenizer):  # noqa: F811
    pairs = task_pairs(TaskConfig(num_problems=40, eval_problems=4), 4)
    rows = preference_rows(pairs, tokenizer, seq_len=48)
    batch = collate_pairs([{k: v[i] for k, v in rows.items()} for i in range(4)])
    assert batch["input_ids"].shape == (8, 48)
    chosen, rejected = batch["labels"][0], batch["labels"][1]
    decode = tokenizer.decode
    assert decode(chosen[chosen != -100].tolist()) == pairs[0]["chosen"]
    assert decode(rejected[rejected != -100].tolist()) == pairs[0]["rejected"]
    assert torch.equal(batch["input_ids"][0, :5], batch["input_ids"][1, :5])  # same prompt


def test_cached_and_model_reference_agree_at_the_start(tokenizer):  # noqa: F811
    """At the start the policy is the reference: every pair's loss is log 2, whichever way the
    reference log-probs come (precomputed once and cached in the rows, or a frozen copy run each step)."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("deepseek_llm_tiny", n_layers=1)
    module = DPOModule(cfg, OptimConfig(), ScheduleConfig(name="constant", warmup_steps=0), micro_batch_size=4,
                       total_steps=1, dpo=DPOConfig(reference="model"))
    module.configure_model()  # starting weights, then the frozen reference copy
    rows = preference_rows(task_pairs(TaskConfig(num_problems=40, eval_problems=4), 6), tokenizer, seq_len=48)
    rows["ref_logps"] = module.reference_logps(rows)
    assert rows["ref_logps"].shape == (6, 2) and (rows["ref_logps"] < 0).all()
    cached = collate_pairs([{k: v[i] for k, v in rows.items()} for i in range(6)])
    live = {k: v for k, v in cached.items() if k != "ref_logps"}
    results = [module.micro_batch_objective(b, module.loss_normalizers(b)) for b in (cached, live)]
    for loss, metrics in results:
        assert loss.item() == pytest.approx(math.log(2), abs=1e-5)
        assert abs(metrics["rewards/margin"].item()) < 1e-5
    # the gradient of the first step agrees too
    grads = []
    for loss, _ in results:
        module.model.zero_grad()
        loss.backward()
        grads.append(module.model.output.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def run(recipe: str, run_dir: Path, *overrides: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), f"hydra.run.dir={run_dir}", "trainer.progress_bar=false",
         "trainer.log_every_n_steps=1", "checkpoint.every_minutes=0", *overrides],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_sft_then_dpo_recipes(tmp_path):
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    run("sft", sft, "model.n_layers=1", "data.seq_len=128", "data.global_batch_size=8", "trainer.max_steps=6",
        "checkpoint.every_n_steps=6", "logger=csv", "task.num_problems=200")
    sft_loss = {k: float(v) for k, v in metric(sft, "train/loss").items()}
    assert sorted(sft_loss) == list(range(6)) and sft_loss[5] < sft_loss[0] - 1.0
    assert (sft / "checkpoints" / "step-6" / "meta.json").is_file()

    run("dpo", dpo, f"init_from={sft}", "trainer.max_steps=8", "dpo.num_pairs=64", "data.global_batch_size=16",
        "data.micro_batch_size=8", "optim.lr=2e-3", "task.num_problems=200")
    loss = [float(v) for _, v in sorted(metric(dpo, "train/loss").items())]
    margin = [float(v) for _, v in sorted(metric(dpo, "train/rewards/margin").items())]
    assert len(loss) == 8 and loss[0] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at step 0
    assert sum(loss[-3:]) / 3 < loss[0] - 0.1
    assert sum(margin[-3:]) / 3 > margin[0] + 0.5
    assert list((dpo / "wandb").glob("offline-run-*")), "W&B offline run missing"
    resolved = (dpo / "resolved_config.yaml").read_text()
    assert f"init_from: {sft}" in resolved and "n_layers: 1" in resolved  # the SFT run's architecture
