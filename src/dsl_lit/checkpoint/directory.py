"""Checkpoints as directories: ``checkpoints/step-<N>/`` holding

- ``model.safetensors``: the weights (safetensors, so loading never unpickles code),
- ``trainer_state.pt``: optimizer, scheduler, loop and data positions (``torch.load(weights_only=True)``),
- ``config.yaml``: the resolved run config,
- ``meta.json``: written last; a directory is published by an atomic rename only once complete.

``StepCheckpoint`` (a Lightning ``ModelCheckpoint``) decides *when*: every N optimizer steps, every M
minutes of wall-clock time (rank 0's clock, broadcast, so every rank saves at the same step), and at
the end of training. ``DirectoryCheckpointIO`` decides *how*: the checkpoint dict (gathered by the
strategy on every rank, synchronously) is copied to CPU memory before training goes on, then
written by one background thread under ``.tmp-step-<N>/`` and renamed to ``step-<N>/`` when
complete; at most one save is in flight, and teardown (end of training, or an exception) waits for
it. After each publication only the newest ``keep_last`` complete directories are kept; a directory
is removed by renaming it to a hidden name first, so a crash mid-removal never leaves a broken
``step-<N>``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import time
import uuid
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsl_lit.utils.fs import publish_dir

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
# Hidden leftovers of an interrupted write or removal (ours, or publish_dir's trash): never read, swept.
_LEFTOVER = re.compile(r"^\.(tmp-step-\d+|removing-step-\d+-[0-9a-f]+|step-\d+\.old-.*)$")
_WEIGHTS = "model.safetensors"
_STATE = "trainer_state.pt"
_META = "meta.json"


def _unshared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (tied embeddings): keep one copy per storage."""
    seen: dict[tuple[int, int], str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
        seen.setdefault(key, name)
    return out


def stage_to_cpu(obj: Any) -> Any:
    """A point-in-time copy of a checkpoint: every tensor copied to CPU memory (the optimizer steps
    parameters and moments in place, so references would not do) and every container rebuilt, so
    nothing training mutates later is shared with the copy. Runs on the caller's thread."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping type (OrderedDict, ...)
        for key, value in obj.items():
            out[key] = stage_to_cpu(value)
        return out
    if isinstance(obj, list):
        return [stage_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        items = [stage_to_cpu(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def _fsync_tree(root: Path) -> None:
    """Flush the files and the directory to disk, so the rename publishes data that survives a crash."""
    for path in root.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_dir(path: Path) -> None:
    """Remove a checkpoint directory: renamed to a hidden name first (atomic), then deleted, so an
    interruption leaves either the whole ``step-<N>`` or a hidden leftover, never a broken one."""
    path = Path(path)
    if not path.exists():
        return
    trash = path.with_name(f".removing-{path.name}-{uuid.uuid4().hex[:8]}")
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune_checkpoints(root: Path, keep_last: int | None, keep: Path | None = None) -> list[Path]:
    """Remove complete ``step-<N>`` directories of ``root`` beyond the ``keep_last`` newest (by N);
    ``keep`` (the one just written) always stays. ``keep_last`` 0 or None keeps all. Incomplete
    ``step-<N>`` directories are left alone (``latest_checkpoint`` skips them); hidden leftovers of
    interrupted writes and removals are swept. Returns the removed directories."""
    root = Path(root)
    for child in root.iterdir():
        if _LEFTOVER.match(child.name):
            shutil.rmtree(child, ignore_errors=True)
    if not keep_last:
        return []
    complete = sorted(
        (int(m.group(1)), child) for child in root.iterdir()
        if (m := STEP_DIR.match(child.name)) and child.is_dir() and is_complete(child)
    )
    keep_resolved = Path(keep).resolve() if keep is not None else None
    others = [child for _, child in complete if child.resolve() != keep_resolved]
    room = keep_last - (1 if keep_resolved is not None and len(others) < len(complete) else 0)
    removed = others[: max(len(others) - room, 0)]  # oldest first
    for child in removed:
        remove_dir(child)
        log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", child, keep_last)
    return removed


class DirectoryCheckpointIO(CheckpointIO):
    """Writes ``step-<N>/`` directories; with ``async_save`` the write happens on a background thread.

    ``save_checkpoint`` runs on global rank 0 only (Lightning's strategies call it there), after the
    strategy gathered full tensors on every rank. It first waits for the previous save (at most one
    in flight; an error of that write is raised here), then, when asynchronous, copies the
    checkpoint to CPU memory and returns while the copy is written. ``teardown`` (end of ``fit``,
    also after an exception) waits for the write in flight.
    """

    def __init__(self, resolved_config: dict[str, Any] | None = None, async_save: bool = False,
                 keep_last: int | None = None) -> None:
        self.resolved_config = resolved_config or {}
        self.async_save = async_save
        self.keep_last = keep_last or None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_path: Path | None = None

    # -- saving ----------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        self.wait()
        final = Path(path)
        if not self.async_save:
            self._write(checkpoint, final)
            return
        staged = stage_to_cpu(checkpoint)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending, self._pending_path = self._executor.submit(self._write, staged, final), final

    def _write(self, checkpoint: dict[str, Any], final: Path) -> None:
        """The whole write of one checkpoint: files under ``.tmp-step-<N>``, flushed, renamed to
        ``step-<N>``, then older ones pruned. On failure the temporary directory is removed."""
        start = time.perf_counter()
        tmp = final.with_name(f".tmp-{final.name}")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            state = dict(checkpoint)
            save_file(_unshared(state.pop("state_dict")), str(tmp / _WEIGHTS))
            torch.save(state, tmp / _STATE)
            (tmp / "config.yaml").write_text(yaml.safe_dump(self.resolved_config, sort_keys=False))
            (tmp / _META).write_text(json.dumps({"global_step": checkpoint.get("global_step"), "complete": True}))
            _fsync_tree(tmp)
            publish_dir(tmp, final)
        except BaseException:
            log.exception("writing checkpoint %s failed", final)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("checkpoint %s written in %.2f s%s", final, time.perf_counter() - start,
                 " (in the background)" if self.async_save else "")
        if STEP_DIR.match(final.name):
            prune_checkpoints(final.parent, self.keep_last, keep=final)

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; re-raise its error."""
        pending, self._pending, self._pending_path = self._pending, None, None
        if pending is not None:
            pending.result()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    # -- loading and removing --------------------------------------------------------------------
    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait()
        path = Path(path)
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint directory (no {_META})")
        state = torch.load(path / _STATE, map_location=map_location or "cpu", weights_only=True)
        state["state_dict"] = load_file(str(path / _WEIGHTS), device="cpu")
        return state

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        self.wait()
        remove_dir(Path(path))


def is_complete(path: Path) -> bool:
    return (path / _META).is_file() and (path / _WEIGHTS).is_file() and (path / _STATE).is_file()


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a usable checkpoint directory, or None. Cheap: reads the safetensors
    header (which must match the file size) and the zip directory of the trainer state, not the data."""
    for name in (_META, _WEIGHTS, _STATE):
        if not (path / name).is_file():
            return f"no {name}"
    try:
        meta = json.loads((path / _META).read_text())
    except (OSError, ValueError) as err:
        return f"unreadable {_META} ({err})"
    if not isinstance(meta, dict) or not meta.get("complete"):
        return f"{_META} does not mark it complete"
    try:
        with safe_open(str(path / _WEIGHTS), framework="pt") as f:
            f.keys()
    except Exception as err:  # safetensors raises its own SafetensorError for a truncated file
        return f"{_WEIGHTS} does not open ({err})"
    try:
        with zipfile.ZipFile(path / _STATE) as z:
            z.namelist()
    except (OSError, zipfile.BadZipFile) as err:
        return f"{_STATE} does not open ({err})"
    return None


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` writing ``step-<N>`` directories (no ``.ckpt`` suffix) every
    ``every_n_steps`` optimizer steps and/or every ``every_minutes`` minutes (0 disables either),
    and after the last step.

    The time trigger reads global rank 0's clock since the last save (or the start of training) and
    broadcasts its decision, so every rank enters the (collective) save at the same step."""

    FILE_EXTENSION = ""

    def __init__(self, dirpath: str | os.PathLike, every_n_steps: int = 0, every_minutes: float = 0.0) -> None:
        super().__init__(
            dirpath=dirpath, filename="step-{step}", auto_insert_metric_name=False,
            every_n_train_steps=0, every_n_epochs=0, save_top_k=-1, save_last=False,
            save_on_train_epoch_end=False,
        )
        self.every_n_steps = every_n_steps
        self.every_minutes = every_minutes
        self._last_save_time: float | None = None
        self.save_durations: list[float] = []
        """Seconds training was blocked by each save (gather, CPU copy, waiting for the previous write)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_save_time = time.monotonic()

    def save_due(self, trainer: Any) -> bool:
        """Whether to save after this step; the same answer on every rank."""
        if self._should_skip_saving_checkpoint(trainer):  # trainer state: identical on every rank
            return False
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            return True
        # SIGTERM (SLURM's warning before preemption): save now; Lightning then stops the loop
        terminating = bool(getattr(trainer, "received_sigterm", False))
        if not (self.every_minutes or trainer.world_size > 1):
            return terminating
        last = self._last_save_time if self._last_save_time is not None else time.monotonic()
        elapsed = bool(self.every_minutes) and time.monotonic() - last >= self.every_minutes * 60
        return bool(trainer.strategy.broadcast(elapsed or terminating, src=0))  # rank 0 decides for all

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.save_due(trainer):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        start = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)
        self.save_durations.append(time.perf_counter() - start)
        self._last_save_time = time.monotonic()  # the interval runs from when training resumed

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Also save the final step, so a finished run always ends with a checkpoint of its weights."""
        if trainer.global_step and self._last_global_step_saved != trainer.global_step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)


def latest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The usable ``step-<N>`` directory with the largest N. Incomplete or corrupt ones (no
    ``meta.json``, a truncated ``model.safetensors`` or ``trainer_state.pt``) are skipped with a
    warning naming them; hidden temporary directories of unfinished writes are ignored."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    candidates = sorted(
        ((int(m.group(1)), child) for child in root.iterdir() if (m := STEP_DIR.match(child.name))), reverse=True
    )
    for _, child in candidates:
        problem = checkpoint_problem(child)
        if problem is None:
            return child
        log.warning("skipping incomplete or corrupt checkpoint %s: %s", child, problem)
    return None
