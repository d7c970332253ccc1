"""PretrainModule under a real Trainer: micro-batching does not change the update, and the loss is
the mean next-token cross-entropy."""

from __future__ import annotations

import csv

import lightning as L
import torch
from torch.utils.data import DataLoader

from dsl_lit.loggers import RunCSVLogger
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.modules import PretrainModule
from dsl_lit.optim import OptimConfig, ScheduleConfig


def _fit_one_step(micro_batch_size: int, batch: dict[str, torch.Tensor]) -> PretrainModule:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("deepseek_llm_tiny", vocab_size=128, n_layers=2, d_model=64, n_heads=4,
                                n_kv_heads=2, ffn_hidden=96)
    # eps=1 makes the first AdamW update ~ g / (|g| + 1): linear in the gradient, so it is compared
    module = PretrainModule(cfg, OptimConfig(lr=1.0, eps=1.0), ScheduleConfig(name="constant", warmup_steps=0),
                            micro_batch_size, total_steps=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    loader = DataLoader([batch], batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    module.logged_loss = trainer.callback_metrics["train/loss"]
    return module


def test_micro_batch_split_gives_the_same_update():
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (8, 33))
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # unequal target counts per micro-batch must still average over the whole step
    batch = {"input_ids": tokens[:, :-1], "labels": labels}
    whole, split = _fit_one_step(8, batch), _fit_one_step(2, batch)
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(whole.logged_loss, split.logged_loss, atol=1e-6, rtol=1e-6)


def test_logged_loss_is_mean_cross_entropy_before_the_update():
    torch.manual_seed(2)
    tokens = torch.randint(0, 128, (4, 17))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("deepseek_llm_tiny", vocab_size=128, n_layers=2, d_model=64, n_heads=4,
                                n_kv_heads=2, ffn_hidden=96)
    reference = build_model(cfg)
    expected = torch.nn.functional.cross_entropy(reference(batch["input_ids"]).reshape(-1, 128),
                                                 batch["labels"].reshape(-1))
    module = _fit_one_step(2, batch)
    torch.testing.assert_close(module.logged_loss, expected, atol=1e-5, rtol=1e-5)
    assert module.tokens_seen == 4 * 16


def test_csv_logger_appends_and_replaces_rows_after_the_resume_step(tmp_path):
    first = RunCSVLogger(tmp_path)
    for step in range(6):
        first.log_metrics({"train/loss": 10.0 - step}, step=step)
    first.save()
    resumed = RunCSVLogger(tmp_path)  # resumed from a checkpoint at step 4: rows 4 and 5 are redone
    for step in range(4, 8):
        resumed.log_metrics({"train/loss": 1.0 * step, "perf/mfu": 0.5}, step=step)
    resumed.save()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(8))
    assert [float(r["train/loss"]) for r in rows] == [10, 9, 8, 7, 4, 5, 6, 7]
    assert rows[0]["perf/mfu"] == "" and rows[7]["perf/mfu"] == "0.5"
