"""torch.profiler traces of training steps, one per rank and cycle, for Perfetto or chrome://tracing.

Why a callback of ours rather than Lightning's ``PyTorchProfiler``: that one wraps each Lightning
hook in its own record and exports per stage; ours profiles whole optimizer steps (forward,
backward, pipeline sends, gradient reduction, optimizer) on a ``torch.profiler.schedule`` and
writes ``<run dir>/profiler/trace_rank<r>_step<N>.json`` (N: the last step in the trace), so the
ranks of one step sit side by side. With ``profile_memory`` on CUDA, a snapshot of the CUDA
allocator over the active steps goes beside it (``memory_rank<r>_step<N>.pickle``, for
https://pytorch.org/memory_viz), where this torch build can record one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from dsl_lit.config.profiler import ProfilerConfig

log = logging.getLogger(__name__)


def can_snapshot_cuda_memory(device: torch.device) -> bool:
    """Whether this build can record the CUDA allocator's history (a private API since torch 2.1)."""
    memory = getattr(torch.cuda, "memory", None)
    return (device.type == "cuda" and torch.cuda.is_available()
            and hasattr(memory, "_record_memory_history") and hasattr(memory, "_dump_snapshot"))


class TraceProfiler(L.Callback):
    def __init__(self, cfg: ProfilerConfig, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.out_dir = Path(run_dir) / "profiler"
        self.profiler: profile | None = None
        self.rank = 0
        self.steps = 0
        self.snapshot = False
        self.traces: list[Path] = []
        self.trainer: L.Trainer | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cfg = self.cfg
        self.rank, self.trainer = trainer.global_rank, trainer
        self.out_dir.mkdir(parents=True, exist_ok=True)
        cuda = pl_module.device.type == "cuda"
        self.snapshot = cfg.profile_memory and can_snapshot_cuda_memory(pl_module.device)
        self.profiler = profile(
            activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])],
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat),
            on_trace_ready=self._write, profile_memory=cfg.profile_memory, record_shapes=cfg.record_shapes,
            with_stack=cfg.with_stack,
        )
        self.profiler.start()

    def _in_cycle(self) -> int | None:
        """Position of the coming step in its wait/warmup/active cycle (None after the last cycle)."""
        cycle, position = divmod(self.steps, self.cfg.steps_per_cycle)
        return None if self.cfg.repeat and cycle >= self.cfg.repeat else position

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.snapshot and self._in_cycle() == self.cfg.wait + self.cfg.warmup:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.profiler is not None:
            self.profiler.step()
            self.steps += 1

    def _write(self, prof: profile) -> None:
        step = self.trainer.global_step
        path = self.out_dir / f"trace_rank{self.rank}_step{step}.json"
        prof.export_chrome_trace(str(path))
        self.traces.append(path)
        log.info("profiler: wrote %s (steps %d-%d)", path, step - self.cfg.active + 1, step)
        if self.snapshot:
            snapshot = self.out_dir / f"memory_rank{self.rank}_step{step}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            log.info("profiler: wrote the CUDA memory snapshot %s", snapshot)

    def _stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()
