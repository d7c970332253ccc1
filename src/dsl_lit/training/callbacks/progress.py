"""Lightning's tqdm bar, counting the run's optimizer steps.

Lightning's bar counts the batches of an epoch: after a resume it starts from the resumed epoch's
remaining batches, so it reads ``Epoch 1: 8/?`` (no total, hence no ETA, and a new "Epoch N" at each
resume), and it shows the logger's version (``v_num``, the W&B run id). This one reads
``train: 8/40 [00:03<00:09, ...]``: the run's step out of ``trainer.max_steps``, its rate and ETA over
this session's steps (tqdm's ``initial``), the same bar across passes over the data, no ``v_num``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm


class StepProgressBar(TQDMProgressBar):
    DESCRIPTION = "train"

    def init_train_tqdm(self) -> Tqdm:
        """Lightning's bar, made with the run's total and its step (tqdm's ``initial``: rate and ETA
        count this session's steps only) rather than the epoch's batches from 0."""
        trainer = self.trainer
        return Tqdm(
            desc=self.DESCRIPTION,
            total=trainer.max_steps if trainer.max_steps > 0 else None,
            initial=trainer.global_step,
            position=(2 * self.process_position),
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        """Nothing: Lightning's resets the bar to the epoch's batches; this one counts the run's steps."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is not None and not bar.disable and self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
