"""PretrainModule under a real Trainer: micro-batching does not change the update, the loss is the
mean next-token cross-entropy, and DeepSeek-V3's MTP, balance loss and bias update behave."""

from __future__ import annotations

import copy
import csv

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data_contract.errors import ConfigError
from dsl_lit.config import TrainConfig
from dsl_lit.config.objective import ObjectiveConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.moe import TopKRouter
from dsl_lit.parallel.strategy import DeepSeekStrategy
from dsl_lit.training import PretrainModule
from dsl_lit.training.loggers import RunCSVLogger
from tests.conftest import compose_config
from tests.numerics import assert_close_fp32


def _llm() -> ModelConfig:
    return ModelConfig.from_name("deepseek_llm_tiny", vocab_size=128, n_layers=2, d_model=64, n_heads=4,
                                 n_kv_heads=2, ffn_hidden=96)


def _v3(**overrides) -> ModelConfig:
    """Tiny V3 with MLA, MoE (node-limited), MTP and a large balance-loss alpha so its gradient shows."""
    return ModelConfig.from_name(
        "deepseek_v3_tiny", **{**dict(vocab_size=128, n_layers=2, n_dense_layers=1, d_model=64, n_heads=4,
                                      q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                      v_head_dim=16, ffn_hidden=96, n_routed_experts=8, n_activated_experts=2,
                                      n_expert_groups=4, n_limited_groups=2, moe_ffn_hidden=32,
                                      seq_balance_alpha=0.1, mtp_depth=2), **overrides})


def _fit(cfg: ModelConfig, micro_batch_size: int, batches: list[dict[str, torch.Tensor]],
         objective: ObjectiveConfig | None = None, logger=False) -> PretrainModule:
    torch.manual_seed(0)
    # eps=1 makes the first AdamW update ~ g / (|g| + 1): linear in the gradient, so it is compared
    module = PretrainModule(cfg, OptimConfig(lr=1.0, eps=1.0), ScheduleConfig(name="constant", warmup_steps=0),
                            micro_batch_size, total_steps=len(batches), objective=objective)
    trainer = L.Trainer(accelerator="cpu", strategy=DeepSeekStrategy(), max_steps=len(batches), logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    module.logged = dict(trainer.callback_metrics)
    module.logged_loss = trainer.callback_metrics["train/loss"]
    return module


def _fit_one_step(micro_batch_size: int, batch: dict[str, torch.Tensor]) -> PretrainModule:
    return _fit(_llm(), micro_batch_size, [batch])


TOKENS = 8 * 32  # rows x seq of _batch: the longest sum behind a loss or a gradient entry


def _batch(seed: int, rows: int = 8, seq: int = 32) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 128, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # unequal target counts per micro-batch must still average over the whole step
    return {"input_ids": tokens[:, :-1], "labels": labels}


@pytest.mark.parametrize("family", ["deepseek_llm", "deepseek_v3"])
def test_micro_batch_split_gives_the_same_update(family):
    """Also covers V3's MTP and balance-loss normalisation and the bias update over the step."""
    cfg = _llm() if family == "deepseek_llm" else _v3()
    batch = _batch(1)
    whole, split = _fit(cfg, 8, [batch]), _fit(cfg, 2, [batch])
    for (name, a), (_, b) in zip(whole.model.state_dict().items(), split.model.state_dict().items()):
        assert_close_fp32(a, b, TOKENS, msg=name)  # eps=1: the update is linear in the gradient
    for key in ("train/loss", "train/mtp_loss", "train/balance_loss"):
        if key in whole.logged:
            assert_close_fp32(whole.logged[key], split.logged[key], TOKENS, msg=key)
    if family == "deepseek_v3":
        assert {"train/mtp_loss", "train/balance_loss"} <= set(whole.logged)


def test_v3_objective_is_main_plus_weighted_mtp_plus_balance():
    cfg, batch = _v3(), _batch(3)
    torch.manual_seed(0)
    reference = build_model(cfg).train()
    hidden = reference.hidden_states(batch["input_ids"])
    labels = batch["labels"]
    main = torch.nn.functional.cross_entropy(reference.head(hidden).flatten(0, 1), labels.flatten())
    mtp = [torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten())
           for k, logits in enumerate(reference.mtp_logits(hidden, batch["input_ids"]), start=1)]
    module = _fit(cfg, 4, [batch])
    assert_close_fp32(module.logged["train/loss"], main, TOKENS, msg="loss")
    assert_close_fp32(module.logged["train/mtp_loss"], sum(mtp) / 2, TOKENS, msg="MTP loss")
    assert_close_fp32(module.logged["train/balance_loss"], reference.balance_loss(), TOKENS, msg="balance loss")


def test_bias_update_sees_every_micro_batch_of_the_step():
    cfg, batch = _v3(), _batch(4)
    torch.manual_seed(0)
    reference = build_model(cfg).train()
    # the loads the whole step routes, MTP blocks included (weights do not change mid-step)
    reference.mtp_logits(reference.hidden_states(batch["input_ids"]), batch["input_ids"])
    routers = [m for m in reference.modules() if isinstance(m, TopKRouter)]
    loads = torch.stack([r.load.counts for r in routers])
    objective = ObjectiveConfig(bias_update_rate=[0.01], bias_update_boundaries=[])
    module = _fit(cfg, 2, [batch], objective=objective)  # 4 micro-batches
    torch.testing.assert_close(module.last_expert_load, loads)
    for router, load in zip([m for m in module.model.modules() if isinstance(m, TopKRouter)], loads):
        torch.testing.assert_close(router.expert_bias, 0.01 * torch.sign(load.mean() - load))
        assert router.load.counts.sum() == 0  # reset for the next step
    # gamma 0 (the last phase of DeepSeek-V3's schedule) leaves the bias alone
    frozen = _fit(cfg, 2, [batch], objective=ObjectiveConfig(bias_update_rate=[0.0], bias_update_boundaries=[]))
    assert all(r.expert_bias.abs().sum() == 0 for r in frozen.model.modules() if isinstance(r, TopKRouter))


def test_mtp_weight_follows_its_schedule(tmp_path):
    objective = ObjectiveConfig(mtp_weight=[0.3, 0.1], mtp_weight_boundaries=[0.5])
    _fit(_v3(mtp_depth=1), 4, [_batch(s) for s in range(4)], objective=objective, logger=RunCSVLogger(tmp_path))
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    weights = {int(r["step"]): float(r["train/mtp_weight"]) for r in rows if r.get("train/mtp_weight")}
    assert weights == {0: pytest.approx(0.3), 1: pytest.approx(0.3), 2: pytest.approx(0.1), 3: pytest.approx(0.1)}


def test_logged_loss_is_mean_cross_entropy_before_the_update():
    torch.manual_seed(2)
    tokens = torch.randint(0, 128, (4, 17))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
    torch.manual_seed(0)
    cfg = _llm()
    reference = build_model(cfg)
    expected = torch.nn.functional.cross_entropy(reference(batch["input_ids"]).reshape(-1, 128),
                                                 batch["labels"].reshape(-1))
    module = _fit_one_step(2, batch)
    assert_close_fp32(module.logged_loss, expected, 4 * 16, msg="loss")
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


def test_z_loss_is_palms_and_has_the_reference_gradient():
    """``objective.z_loss_weight``: the objective gains ``w * mean over targets of logsumexp(logits)^2``
    (``z_loss``, next to the unchanged ``loss``), and the gradients are those of F.cross_entropy +
    logsumexp on the same logits; micro-batching does not change the update, ``train/z_loss`` is logged."""
    weight, batch = 1e-2, _batch(5)
    torch.manual_seed(0)
    module = PretrainModule(_llm(), OptimConfig(), ScheduleConfig(name="constant", warmup_steps=0), 8, total_steps=1,
                            objective=ObjectiveConfig(z_loss_weight=weight))
    module.configure_model()
    reference = copy.deepcopy(module.model)
    normalizers = module.loss_normalizers(batch)
    objective, metrics = module.loss_from_outputs(module.model_outputs(batch["input_ids"]), batch, normalizers)
    objective.backward()
    labels = batch["labels"]
    logits = reference(batch["input_ids"])
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    z_loss = weight * logits.logsumexp(-1)[labels != -100].square().mean()
    (ce + z_loss).backward()
    assert_close_fp32(metrics["loss"], ce.detach(), TOKENS, msg="loss")
    assert_close_fp32(metrics["z_loss"], z_loss.detach(), TOKENS, msg="z_loss")
    for (name, ours), (_, theirs) in zip(module.model.named_parameters(), reference.named_parameters()):
        assert_close_fp32(ours.grad, theirs.grad, TOKENS, msg=name)

    objective = ObjectiveConfig(z_loss_weight=weight)
    whole, split = _fit(_llm(), 8, [batch], objective=objective), _fit(_llm(), 2, [batch], objective=objective)
    for (name, a), (_, b) in zip(whole.model.state_dict().items(), split.model.state_dict().items()):
        assert_close_fp32(a, b, TOKENS, msg=name)
    assert_close_fp32(whole.logged["train/z_loss"], split.logged["train/z_loss"], TOKENS, msg="train/z_loss")
    assert "train/z_loss" not in _fit_one_step(8, batch).logged  # off by default


@pytest.mark.parametrize("value", ["-0.1", "nan"])
def test_z_loss_weight_is_validated(value):
    cfg = compose_config("pretrain", [f"objective.z_loss_weight={value}"])
    with pytest.raises(ConfigError, match=rf"^objective\.z_loss_weight={value} must be a number >= 0"):
        TrainConfig.from_hydra(cfg, run_dir="unused")
