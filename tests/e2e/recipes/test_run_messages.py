"""Runs that say what they are doing (issue 41, item 2): a line every ``log_every_n_steps`` and at the
last step (which also reaches metrics.csv), validation lines, a closing summary, the start-up block and
``resolved_config.yaml`` with the model field by field and its parameter counts, a progress bar that
counts the run's steps after a resume, known third-party noise silenced, and report.py's reason when a
run has no metrics.csv.

Fast: the callbacks on a tiny in-process module, the resolved view of composed configs, the filters,
report.py's reasons. Slow: the recipe, a run shorter than ``log_every_n_steps`` and its resume.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from dsl_lit.config import TrainConfig
from dsl_lit.models import build_model
from dsl_lit.training.callbacks.progress import StepProgressBar
from dsl_lit.training.callbacks.run_log import RunLog, closing_lines
from dsl_lit.training.loggers import RunCSVLogger
from dsl_lit.training.noise import silence_known_noise
from dsl_lit.training.run_info import resolved_view, startup_lines
from dsl_lit.training.runs import save_resolved_config
from tests.conftest import ROOT, compose_config
from tests.recipe_runs import losses, run_recipe

RUN_LOG = "dsl_lit.training.callbacks.run_log"


class Logged(BoringModel):
    """Lightning's demo model logging what ours log: train/loss, train/lr, val/loss."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])
        self.log("train/lr", 0.1)
        return out

    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val/loss", loss)
        return loss


class LoggedIndexer(Logged):
    """As DeepSeek-V3.2's indexer training logs: its KL and top-k recall too."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/index_kl", 0.25)
        self.log("train/index_recall", 0.5)
        return out


def test_the_indexer_training_is_on_the_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=RUN_LOG):
        _trainer(tmp_path, 2, RunLog(), log_every_n_steps=2).fit(LoggedIndexer())
    [line] = [r.getMessage() for r in caplog.records if r.name == RUN_LOG and r.getMessage().startswith("step ")]
    assert re.fullmatch(r"step 2/2 \| loss \d+\.\d{4} \| lr 1\.000e-01 \| index KL 0\.2500, recall 0\.500 \| 0:00:\d\d elapsed", line)


def _trainer(tmp_path: Path, steps: int, *callbacks: L.Callback, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", max_steps=steps, max_epochs=-1, enable_checkpointing=False,
                   enable_model_summary=False, enable_progress_bar=False, logger=False, num_sanity_val_steps=0,
                   limit_val_batches=0, default_root_dir=tmp_path, callbacks=list(callbacks))
    return L.Trainer(**{**options, **kwargs})


def test_a_line_every_n_steps_the_last_step_always_and_its_row(tmp_path, caplog):
    """log_every_n_steps=2 over 5 steps: lines at 2 and 4, and at 5 (the last), whose values reach
    metrics.csv too; validation at 3 is one line; log_every_n_steps is Lightning's again afterwards."""
    run_log = RunLog()
    trainer = _trainer(tmp_path, 5, run_log, logger=RunCSVLogger(tmp_path), log_every_n_steps=2,
                       limit_val_batches=1, val_check_interval=3, check_val_every_n_epoch=None)
    with caplog.at_level(logging.INFO, logger=RUN_LOG):
        trainer.fit(Logged())
    lines = [r.getMessage() for r in caplog.records if r.name == RUN_LOG]
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in steps] == ["step 2/5", "step 4/5", "step 5/5"], lines
    assert re.fullmatch(r"step 2/5 \| loss \d+\.\d{4} \| lr 1\.000e-01 \| 0:00:\d\d elapsed, ETA 0:00:\d\d", steps[0])
    assert "ETA" not in steps[-1]  # the last line: nothing left
    [val] = [line for line in lines if line.startswith("validation")]
    assert re.fullmatch(r"validation at step 3/5: val/loss \d+\.\d{4} \(best val/loss \d+\.\d{4} at step 3\)", val)
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["step"]) for r in rows if r["train/loss"]) == [1, 3, 4]  # steps 2, 4 and the last, 5
    assert float(next(r for r in rows if r["step"] == "4")["train/loss"]) == pytest.approx(run_log.last_loss[1])
    assert trainer.log_every_n_steps == 2
    summary = closing_lines(trainer, run_log, tmp_path, "runs/x/checkpoints/step-5", "python r.py run_name=x")
    assert summary[0].startswith("finished at step 5/5: 5 step(s) in 0:00:")
    assert re.match(r"final loss \d+\.\d{4} \(step 5\); val/loss \d+\.\d{4} \(step 3\), best \d+\.\d{4} \(step 3\)",
                    summary[1]), summary
    assert summary[2:] == ["checkpoint runs/x/checkpoints/step-5",
                           "to train on, raise trainer.max_steps in: python r.py run_name=x"]


def test_a_run_shorter_than_log_every_n_steps_logs_its_last_step(tmp_path, caplog):
    trainer = _trainer(tmp_path, 3, RunLog(), logger=RunCSVLogger(tmp_path), log_every_n_steps=50)
    with caplog.at_level(logging.INFO, logger=RUN_LOG):
        trainer.fit(Logged())
    with (tmp_path / "metrics.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [2]
    assert [r.getMessage().split(" | ")[0] for r in caplog.records if r.getMessage().startswith("step ")] == ["step 3/3"]


def test_the_progress_bar_counts_the_runs_steps_after_a_resume(tmp_path):
    """Lightning's bar reads ``Epoch 1: 8/?`` after a resume (the epoch's batches: no total, no ETA)
    and shows the logger's version; ours: ``train: 3/5`` onwards, total max_steps, rate from this
    session's steps (tqdm's ``initial``), no v_num."""
    first = _trainer(tmp_path, 3, StepProgressBar(), enable_progress_bar=True, logger=CSVLogger(tmp_path))
    first.fit(Logged())
    first.save_checkpoint(tmp_path / "step3.ckpt")
    bar_callback = StepProgressBar()
    resumed = _trainer(tmp_path, 5, bar_callback, enable_progress_bar=True, logger=CSVLogger(tmp_path))
    resumed.fit(Logged(), ckpt_path=tmp_path / "step3.ckpt")
    bar = bar_callback.train_progress_bar
    assert (bar.total, bar.initial, bar.n, bar.desc) == (5, 3, 5, "train")
    assert re.match(r"train: 100%\|.*\| 5/5 \[\d\d:\d\d<00:00, ", str(bar)), str(bar)
    assert "v_num" in TQDMProgressBar.get_metrics(bar_callback, resumed, resumed.lightning_module)  # Lightning's
    assert "v_num" not in bar_callback.get_metrics(resumed, resumed.lightning_module)


def _config(tmp_path: Path, *overrides: str) -> TrainConfig:
    return TrainConfig.from_hydra(compose_config("pretrain", list(overrides)), run_dir=str(tmp_path))


def test_resolved_config_holds_the_model_field_by_field_and_its_parameter_counts(tmp_path, caplog):
    cfg = _config(tmp_path, "model=deepseek_llm_tiny", "+model.n_layers=2")
    with caplog.at_level(logging.INFO, logger="dsl_lit.training.runs"):
        path = save_resolved_config(cfg)
    saved = yaml.safe_load(path.read_text())
    assert cfg.raw["model"] == {"name": "deepseek_llm_tiny", "n_layers": 2}  # checkpoints keep the composed group
    model = saved["model"]
    assert model["name"] == "deepseek_llm_tiny" and model["family"] == "deepseek_llm"
    assert (model["n_layers"], model["d_model"], model["n_kv_heads"], model["vocab_size"]) == (2, 256, 4, 8192)
    assert "n_routed_experts" not in model and "kv_lora_rank" not in model  # fields this family never reads
    with torch.device("meta"):
        total = build_model(cfg.model).num_params()
    assert saved["derived"]["parameters"] == {"total": total, "activated_per_token": total, "mtp": 0}
    assert saved["derived"]["layout"]["world_size"] == 1 and saved["derived"]["precision"] == "fp32"
    # the saved model section is a model group a config accepts as it is
    assert TrainConfig.from_hydra(OmegaConf.create(saved), run_dir=str(tmp_path)).model == cfg.model
    block = [r.getMessage() for r in caplog.records if r.name == "dsl_lit.training.runs"]
    assert block[0] == f"model deepseek_llm_tiny (family deepseek_llm): {total / 1e6:.2f}M total, " \
                       f"{total / 1e6:.2f}M activated per token"
    assert "n_layers=2 d_model=256" in block[1]
    assert block[2] == "layout 1 process: dp=1 tp=1 pp=1 ep=1 cp=1 on cpu; precision fp32, compile off"


def test_a_moe_model_counts_activated_and_mtp_parameters(tmp_path):
    cfg = _config(tmp_path, "model=deepseek_v3_tiny", "trainer.accelerator=cpu")
    view = resolved_view(cfg)
    params = view["derived"]["parameters"]
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert params == {"total": model.num_params(), "activated_per_token": model.num_params(activated=True),
                      "mtp": model.num_params(include_mtp=True) - model.num_params()}
    assert params["activated_per_token"] < params["total"] and params["mtp"] > 0
    assert view["model"]["n_routed_experts"] == cfg.model.n_routed_experts and "n_kv_heads" not in view["model"]
    assert "(+2.01M in 1 MTP module(s))" in startup_lines(cfg, view["derived"])[0]


def test_known_noise_is_silenced_by_its_message_and_nothing_else():
    silence_known_noise()
    silence_known_noise()  # idempotent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        silence_known_noise()  # catch_warnings restores the filters on exit: install inside
        warnings.warn("Checkpoint directory /runs/x/checkpoints exists and is not empty.", UserWarning, stacklevel=1)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("Checkpoint directory is on a slow disk", UserWarning, stacklevel=1)  # another message: shown
    assert [str(w.message) for w in caught] == ["Checkpoint directory is on a slow disk"]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, "💡 Tip: For seamless cloud logging ...",
                               None, None)
    assert not logger.filter(record)
    assert logger.filter(logger.makeRecord(logger.name, logging.INFO, __file__, 0, "GPU available: False", None, None))


def _report_module():
    spec = importlib.util.spec_from_file_location("report_recipe", ROOT / "recipes" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_says_why_a_run_has_no_metrics(tmp_path):
    why = _report_module().why_no_metrics
    assert why(tmp_path / "missing") == "no such directory"
    assert "not a run directory" in why(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved_config.yaml").write_text(yaml.safe_dump({"logger": {"csv": False, "wandb": None}}))
    assert why(run).startswith("the run was made with logger.csv=false")
    (run / "resolved_config.yaml").write_text(yaml.safe_dump({"logger": {"csv": True}}))
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    assert why(run).startswith("the run logged no metrics: it stopped, or is still starting, before its first "
                               "logged step") and why(run).endswith("it has 1 checkpoint(s)")


@pytest.mark.slow
def test_a_short_run_says_what_it_does_and_its_resume_shows_a_total(tmp_path):
    """A 2-step run with log_every_n_steps=5: its last step is a line and a metrics.csv row; the log
    holds the start-up block, the validation line and the closing summary; resumed to 5 steps, the
    progress bar counts 2 -> 5 of 5 with an ETA, without "Epoch", v_num or Lightning's warning about
    the checkpoint directory."""
    run = tmp_path / "run"
    common = ["model=deepseek_llm_tiny", "logger=csv", "trainer.log_every_n_steps=5", "trainer.val_every_n_steps=2",
              "data.val_windows=8", "checkpoint.every_n_steps=2", "checkpoint.every_minutes=0"]
    run_recipe(run, *common, "trainer.max_steps=2")
    assert sorted(losses(run)) == [1]  # step 2 of 2, though log_every_n_steps=5
    log = (run / "pretrain.log").read_text()
    assert re.search(r"model deepseek_llm_tiny \(family deepseek_llm\): \d+\.\d\dM total", log)
    assert re.search(r"layout 1 process: dp=1 tp=1 pp=1 ep=1 cp=1 on cpu; precision fp32, compile off", log)
    assert re.search(r"step 2/2 \| loss \d+\.\d{4} \| lr \S+ \| [\d,]+ tokens/s \| 0:00:\d\d elapsed\n", log)
    assert re.search(r"validation at step 2/2: val/loss \d+\.\d{4} \(best val/loss \d+\.\d{4} at step 2\)", log)
    assert re.search(r"finished at step 2/2: 2 step\(s\) in 0:00:\d\d, [\d,]+ tokens/s\n", log)
    assert re.search(r"final loss \d+\.\d{4} \(step 2\); val/loss \d+\.\d{4} \(step 2\), best \d+\.\d{4} \(step 2\); "
                     r"1,024 tokens seen\n", log)  # 2 steps x 8 sequences x 64 tokens
    assert f"checkpoint {run / 'checkpoints' / 'step-2'}\n" in log
    [command] = re.findall(r"to train on, raise trainer\.max_steps in: (.*recipes/pretrain\.py .*)\n", log)
    assert f"hydra.run.dir={run} " in command and command.endswith(" trainer.max_steps=2"), command
    resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert resolved["model"]["n_layers"] == 2 and resolved["model"]["d_model"] == 256 and resolved["derived"]["parameters"]["total"] > 0

    resumed = run_recipe(run, *common, "trainer.max_steps=5", "trainer.progress_bar=true")
    assert re.search(r"train: +\d+%\|[^|]*\| 5/5 \[\d\d:\d\d<00:00", resumed.stdout), resumed.stdout[-2000:]
    assert re.search(r"train: +\d+%\|[^|]*\| 3/5 \[\d\d:\d\d<\d\d:\d\d", resumed.stdout), resumed.stdout[-2000:]
    output = resumed.stdout + resumed.stderr
    for absent in ("Epoch", "v_num", "exists and is not empty", "LeafSpec", "litlogger"):
        assert absent not in output, absent
    log = (run / "pretrain.log").read_text()
    assert "training from step 2 (resumed) to 5" in log and "finished at step 5/5: 3 step(s)" in log
    assert sorted(losses(run)) == [1, 4]
