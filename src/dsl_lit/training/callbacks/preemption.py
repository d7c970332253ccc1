"""SIGTERM (SLURM's preemption warning) on any rank: every rank finishes its step, the step is
saved once, and every process exits 143.

Why not Lightning's own handler: it calls ``dist.broadcast`` inside the signal handler, which runs
wherever the main thread happens to be (a backward hook, the middle of a gradient all-reduce), so
ranks enter different collectives and hang. Here the handler only records the signal (and, in the
launching process, forwards it to the ranks it started); the ranks agree at one fixed point, the
end of each optimizer step, with a max-all-reduce of their flags, so a signal to any subset of
ranks stops all of them after the same step. The checkpoint callback runs after this one
(Lightning orders checkpoint callbacks last) and saves that step; Lightning's loop then raises
``SIGTERMException`` on every rank and the recipe exits 143.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class PreemptionHandler(L.Callback):
    def __init__(self) -> None:
        self.signalled = False
        self._previous: Any = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Only record it (no collectives, no I/O beyond a log line): see the module docstring."""
        if not self.signalled:
            log.warning("SIGTERM received: finishing the current step, then saving it and exiting")
        self.signalled = True
        launcher = getattr(self._trainer.strategy, "launcher", None) if self._trainer is not None else None
        if launcher is not None and getattr(launcher, "procs", None):
            launcher.kill(signum)  # the ranks this process started (they may not have been signalled)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning installs its handler at the start of fit; replace it for the training loop.
        self._trainer = trainer
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """The agreement point: a signal seen by any rank stops every rank after this step."""
        stop = self.signalled
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(stop)], device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            self.signalled = True
            trainer._signal_connector.received_sigterm = True  # the checkpoint callback and the loop read it
