"""lm-evaluation-harness tasks inside the training loop: every ``eval.every_n_steps`` optimizer
steps, on the weights of that step, under any parallel layout.

Every rank takes part: each holds a whole model (its own replica, or a single-device copy
gathered from the shards when tensor, pipeline or expert parallelism splits it, as GRPO's
sampler does) and scores its share of the requests, which lm-eval splits by rank and gathers
back on rank 0. Rank 0 logs ``eval/<task>/<metric>`` (and ``eval/time_s``) and writes lm-eval's results.json to
``<run dir>/eval/step-<N>/``. The run's random generators are saved before and restored after,
so evaluating (seeded by ``eval.seed``) leaves training exactly as it would have been.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from dsl_lit.config.eval import EvalConfig
from dsl_lit.evaluation.harness import Harness, flat_metrics, write_results
from dsl_lit.evaluation.tokenizer import EvalTokenizer
from dsl_lit.models import build_model
from dsl_lit.precision.plugin import DTYPES
from dsl_lit.training.callbacks.rng_state import rng_state, set_rng_state

log = logging.getLogger(__name__)


def whole_model(pl_module: Any) -> nn.Module:
    """The module's model when this rank holds all of it; otherwise a fresh single-device copy
    with the gathered weights (collective: every rank calls it at the same point)."""
    runner = pl_module.runner
    if not runner.shards_model:
        return pl_module.model
    with torch.random.fork_rng(devices=[]):  # the copy's throwaway init must not move the run's generators
        copy = build_model(pl_module.model_config).to(pl_module.device).eval().requires_grad_(False)
    copy.load_state_dict(runner.full_state_dict(pl_module.model))
    return copy


def log_at_this_step(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Straight to the loggers, at the row of this step's training metrics (as Lightning's
    LearningRateMonitor does): through ``self.log``, a value logged only every N steps is logged
    again at the next step too."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)


class DownstreamEvaluation(L.Callback):
    def __init__(self, cfg: EvalConfig, run_dir: str | Path, precision: str = "fp32") -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.autocast_dtype = DTYPES[precision]
        self.harness = Harness(cfg)  # a misspelt task fails here, before training starts
        self.tokenizer: EvalTokenizer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Read the tokenizer once the data module prepared its cache: a run on a fresh
        ``data.cache_dir`` builds the tokenizer there first (reading it at construction failed
        with "tokenizer.json missing")."""
        self.tokenizer = EvalTokenizer.from_dir(self.cfg.tokenizer_dir)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step % self.cfg.every_n_steps == 0:
            self.evaluate(trainer, pl_module, step)

    def evaluate(self, trainer: L.Trainer, pl_module: Any, step: int) -> dict[str, float]:
        from dsl_lit.evaluation.lm import DslLitLM  # lm-eval takes seconds to import

        start = time.perf_counter()
        model = whole_model(pl_module)
        states = rng_state()
        try:
            lm = DslLitLM(model, self.tokenizer, batch_size=self.cfg.batch_size, max_gen_toks=self.cfg.max_gen_toks,
                          autocast_dtype=self.autocast_dtype, model_info={"global_step": step})
            results = self.harness.evaluate(lm)
        finally:
            set_rng_state(states)
        if not trainer.is_global_zero or results is None:
            return {}
        write_results(results, self.run_dir / "eval" / f"step-{step}")
        metrics = flat_metrics(results)
        metrics["eval/time_s"] = time.perf_counter() - start
        log_at_this_step(trainer, metrics)
        log.info("step %d: %s", step, ", ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in metrics.items()))
        return metrics

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.harness.close()
