"""When a rank dies or stops answering, the others stop too, within a bounded time, and say which.

A collective with a dead peer fails at once (gloo: "Connection closed by peer") or, with a peer
that hangs, after the process group's timeout (``trainer.collective_timeout_s``). Either way the
error names no rank. On such a failure every surviving rank checks in on the rendezvous store;
the ranks that have not checked in after a short wait are the lost ones, and the error each
survivor logs names them and the checkpoint a rerun resumes from.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

log = logging.getLogger(__name__)

_KEY = "dsl_lit/alive_after_failure/{}"


def is_collective_failure(exception: BaseException) -> bool:
    """A failed or timed-out collective (as raised by gloo and NCCL process groups)."""
    if isinstance(exception, getattr(dist, "DistError", ())):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Timed out", "timed out", "Connection reset",
                                      "NCCL communicator was aborted", "Socket Timeout",
                                      # gloo, a peer that stops answering inside a barrier (measured
                                      # under load: the hung-rank test's rank 0 got this, not "Timed out")
                                      "Application timeout caused pair closure")
    )


def unresponsive_ranks(rank: int, world_size: int, wait_s: float = 5.0) -> list[int] | None:
    """Ranks that did not check in on the default store within ``wait_s`` seconds (every survivor
    calls this after the failure). None when the store itself is gone (rank 0 hosts it: lost)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_KEY.format(rank), "1")
        deadline = time.monotonic() + wait_s
        keys = [_KEY.format(r) for r in range(world_size)]
        while time.monotonic() < deadline and not store.check(keys):
            time.sleep(0.1)
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except Exception:  # noqa: BLE001 - the store's host (rank 0) is gone: that is the answer
        return None


class RankFailureReporter(L.Callback):
    """On a collective failure, log which ranks were lost and where a rerun resumes."""

    def __init__(self, checkpoint_dir: str | Path, wait_s: float = 5.0, resume: str | None = None) -> None:
        """``resume``: what the report ends with (the run dir and the command that resumes it,
        :func:`~dsl_lit.training.resume_command.stop_hint`); default: rerun the same command."""
        self.checkpoint_dir = Path(checkpoint_dir)
        self.wait_s = wait_s
        self.resume = resume

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.world_size == 1 or not is_collective_failure(exception) or not dist.is_initialized():
            return
        lost = unresponsive_ranks(trainer.global_rank, trainer.world_size, self.wait_s)
        who = "rank 0 (it hosts the rendezvous store)" if lost is None else (
            "rank(s) " + ", ".join(map(str, lost)) if lost else "no rank (all checked in; a network failure?)")
        where = f"the latest complete checkpoint in {self.checkpoint_dir}"
        log.error(
            "rank %d: a collective failed (%s); lost %s. %s", trainer.global_rank,
            str(exception).splitlines()[0][:200], who,
            f"Resume from {where}: {self.resume}" if self.resume else f"Rerun the same command to resume from {where}",
        )

    def state_dict(self) -> dict[str, Any]:
        return {}
