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

Leaving is the last hazard. A launcher (torchrun's agent, SLURM's step) SIGTERMs the ranks still
running once the first one exits: a rank still tearing down would then run Lightning's handler,
which broadcasts from inside the handler (measured in CI: rank 0 inside the teardown's
``module.cpu()`` failed with "Connection closed by peer" and never printed its resume line), or
be killed before its last line. So once the stop is agreed this handler stays installed through
the teardown, and :func:`exit_together` makes every rank ignore SIGTERM and wait for the others
before any of them exits.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any, NoReturn

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
        if not self.signalled:  # after an agreed stop, a second SIGTERM must not reach Lightning's handler
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


def exit_together(code: int) -> NoReturn:
    """Exit with ``code`` once every rank has reached this point (after the trainer's teardown), with
    SIGTERM ignored from here on: the launcher's SIGTERM, sent when the first rank exits, can then
    neither break a peer's last collective nor kill rank 0 before its last line. A peer that is
    already gone (the barrier fails) does not keep this rank: it exits all the same. One process
    just exits (its handlers untouched)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()
        except Exception as error:  # noqa: BLE001 - leaving regardless; say why the wait ended
            log.warning("not every rank reached the exit (%s); exiting %d", str(error).splitlines()[0], code)
    raise SystemExit(code)
