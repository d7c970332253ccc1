"""Passkey retrieval inside the training loop, and a stop once the model retrieves.

A small transformer learns retrieval abruptly (an induction head forms): in this project's
context base none at step 1,000 and most prompts a few hundred steps later, at a step that moves
with the seed. A fixed step count therefore hands some seeds' context extension a base that
retrieves nothing (measured: seed 1234 82% at 1,500 steps, seed 1 0%). ``eval.passkey.stop_at``
trains until the probe retrieves that share instead, ``trainer.max_steps`` being the cap.

The probe scores its own prompts (``eval.passkey.seed``), one forward each, under the run's
autocast and with the run's random generators saved and restored, so probing leaves training
exactly as it would have been. Every rank probes the same weights; rank 0's share decides the stop.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from tokenizers import Tokenizer

from dsl_lit.config.eval import PasskeyProbeConfig
from dsl_lit.evaluation.passkey import passkey_outcomes
from dsl_lit.precision.plugin import DTYPES
from dsl_lit.training.callbacks.downstream_eval import log_at_this_step, whole_model
from dsl_lit.training.callbacks.rng_state import rng_state, set_rng_state

log = logging.getLogger(__name__)


class PasskeyProbe(L.Callback):
    def __init__(self, cfg: PasskeyProbeConfig, length: int, tokenizer_dir: str, precision: str = "fp32") -> None:
        self.cfg = cfg
        self.length = length
        self.tokenizer_dir = tokenizer_dir
        self.autocast_dtype = DTYPES[precision]
        self.tokenizer: Tokenizer | None = None
        self.history: list[tuple[int, float]] = []
        """(step, share retrieved) of every probe of this run (kept in its checkpoints)."""
        self.stopped_at: int | None = None
        """The step whose probe reached ``stop_at``: a rerun of the stopped run trains no further."""

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(h) for h in self.history], "stopped_at": self.stopped_at}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [(int(step), float(share)) for step, share in state_dict.get("history", [])]
        self.stopped_at = state_dict.get("stopped_at")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Resumed from the step where the probe stopped the run: stop again before any step (the
        command run twice must not train past its stop), unless ``stop_at`` was raised or dropped."""
        if self.stopped_at is None or self.stopped_at != trainer.global_step:
            return
        share = dict(self.history).get(self.stopped_at, 0.0)
        if self.cfg.stop_at is not None and share >= self.cfg.stop_at:
            log.info("step %d: this run stopped here, its passkey retrieval %.0f%% >= eval.passkey.stop_at=%g; "
                     "raise eval.passkey.stop_at (or set it null) to train on", self.stopped_at, 100 * share,
                     self.cfg.stop_at)
            trainer.should_stop = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """The tokenizer once the data module has built it (a fresh ``data.cache_dir`` has none before)."""
        self.tokenizer = Tokenizer.from_file(f"{self.tokenizer_dir}/tokenizer.json")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step % self.cfg.every_n_steps:
            return
        share = self.probe(pl_module)
        self.history.append((step, share))
        metric = {f"eval/passkey/{self.length}": share}
        stop = self.cfg.stop_at is not None and share >= self.cfg.stop_at
        stop = bool(trainer.strategy.broadcast(stop, src=0))
        if trainer.is_global_zero:
            log_at_this_step(trainer, metric)
            log.info("step %d: passkey retrieval at %d tokens %.0f%%%s", step, self.length, 100 * share,
                     f" >= eval.passkey.stop_at={self.cfg.stop_at:g}: stopping here" if stop else "")
        if stop:
            self.stopped_at = step
            trainer.should_stop = True  # Lightning ends the loop after this step; the last step is saved

    def probe(self, pl_module: Any) -> float:
        """The share of the probe's prompts retrieved by the current weights."""
        assert self.tokenizer is not None, "setup() reads the tokenizer"
        model = whole_model(pl_module)
        was_training = model.training
        states = rng_state()
        try:
            with torch.compiler.set_stance("force_eager"), torch.autocast(
                    pl_module.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype != torch.float32):
                outcomes = passkey_outcomes(model, self.tokenizer, [self.length], self.cfg.depths,
                                            self.cfg.per_depth, self.cfg.seed, pl_module.device)
        finally:
            model.train(was_training)
            set_rng_state(states)
        hits = [hit for row in outcomes.values() for hits in row.values() for hit in hits]
        return sum(hits) / len(hits)
