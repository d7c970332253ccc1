"""The step's scalars reach ``self.log`` only on the steps Lightning writes (``CausalLMModule.
defer_step_logs``, set by RunLog): the metrics file holds the same rows and values as when every step
logs, for a fraction of the calls (each ~1.5 ms on CPU: 40% of a tiny model's step before)."""

from __future__ import annotations

import csv

import lightning as L
import torch
from torch.utils.data import DataLoader

from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.models import ModelConfig
from dsl_lit.parallel.strategy import DeepSeekStrategy
from dsl_lit.training import PretrainModule
from dsl_lit.training.callbacks.run_log import RunLog
from dsl_lit.training.callbacks.throughput import ThroughputMonitor
from dsl_lit.training.loggers import RunCSVLogger

STEPS, EVERY = 7, 3  # written: steps 3 and 6 (every 3rd) and 7 (the last)


class CountingModule(PretrainModule):
    calls = 0

    def log(self, *args, **kwargs) -> None:
        type(self).calls += 1
        super().log(*args, **kwargs)


class EveryStep(L.Callback):
    """After RunLog's on_fit_start: the module logs every step, as without deferral."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.defer_step_logs = False


def _run(tmp_path, defer: bool) -> tuple[list[dict[str, str]], int]:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("deepseek_llm_tiny", vocab_size=128, n_layers=1, d_model=32, n_heads=2,
                                n_kv_heads=1, ffn_hidden=48)
    CountingModule.calls = 0
    module = CountingModule(cfg, OptimConfig(lr=1e-3), ScheduleConfig(name="constant", warmup_steps=0), 2,
                            total_steps=STEPS)
    batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]}
               for t in torch.randint(0, 128, (STEPS, 4, 17), generator=torch.Generator().manual_seed(1))]
    callbacks = [ThroughputMonitor(1e6, "fp32", peak=1.0), RunLog(), *([] if defer else [EveryStep()])]
    trainer = L.Trainer(accelerator="cpu", strategy=DeepSeekStrategy(), max_steps=STEPS, callbacks=callbacks,
                        logger=RunCSVLogger(tmp_path / ("defer" if defer else "every")), log_every_n_steps=EVERY,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    assert module.defer_step_logs is False  # reset at teardown: a later fit without RunLog logs every step
    with open(next((tmp_path / ("defer" if defer else "every")).rglob("metrics.csv"))) as f:
        return list(csv.DictReader(f)), CountingModule.calls


def test_the_metrics_file_is_the_same_for_a_fraction_of_the_log_calls(tmp_path):
    deferred, deferred_calls = _run(tmp_path, defer=True)
    every, every_calls = _run(tmp_path, defer=False)
    timing = ("perf/step_time_s", "perf/tokens_per_s", "perf/mfu")  # wall-clock: differs run to run
    assert [r["step"] for r in deferred] == [r["step"] for r in every] and len(deferred) == 3
    for a, b in zip(deferred, every, strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
        assert all(a[k] for k in timing) and a["train/loss"] and a["train/grad_norm"] and a["perf/tokens_seen"]
    keys = every_calls // STEPS  # the scalars one step logs
    assert every_calls == keys * STEPS and keys >= 9  # loss, lr, grad norm, batch, skipped; 4 perf
    assert deferred_calls == keys * 3  # only the three written steps
