"""Checkpoints as directories: ``checkpoints/step-<N>/`` holding

- ``shards/*.safetensors``: every tensor (weights, optimizer moments, EMA), written by all ranks
  through ``torch.distributed.checkpoint``, each rank its own shards (:mod:`dsl_lit.checkpoint.sharded`);
  any other layout reads them back, resharded;
- ``trainer_state.pt``: the rest of the checkpoint dict (loop, scheduler and data positions, loss
  scaler, RNG states), written by rank 0 (``torch.load(weights_only=True)``);
- ``config.yaml``: the resolved run config;
- ``tokenizer/``: a copy of the run's tokenizer (``<run dir>/tokenizer``, when the run recorded one:
  :mod:`dsl_lit.checkpoint.tokenizer`), its hash in ``meta.json``'s ``tokenizer``;
- ``meta.json``: written last, naming every file with its size and checksum
  (:mod:`dsl_lit.checkpoint.integrity`); a directory is published by an atomic rename only once
  complete, and a step saved again (after a resume fell back past it) replaces its directory the
  same way, the old one removed only once the new one is in place.

``StepCheckpoint`` (a Lightning ``ModelCheckpoint``) decides *when*: every N optimizer steps, every M
minutes of wall-clock time (rank 0's clock, broadcast, so every rank saves at the same step), and at
the end of training. ``DirectoryCheckpointIO`` decides *how*: every rank enters ``save_checkpoint``
with its own part of the checkpoint (no rank gathers the model). Asynchronously, each rank's tensors
are copied to CPU memory before training goes on and written by a background thread under
``.tmp-step-<N>/``; rank 0 renames it to ``step-<N>/`` once every rank's shards are written. At most
one save is in flight; teardown (end of training, or an exception) waits for it. After each
publication only the newest ``keep_last`` step directories we wrote are kept; a directory is removed
by renaming it to a hidden name first, so a crash mid-removal never leaves a broken ``step-<N>``.
Loading verifies the checksums and falls back past a checkpoint that fails (``load_checkpoint``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO
from torch.distributed.checkpoint.api import CheckpointException

from data_contract.errors import ConfigError
from data_contract.fs import publish_dir
from dsl_lit.checkpoint.files import (
    CONFIG,
    META,
    SHARDS,
    STATE,
    CorruptCheckpoint,
    checkpoint_problem,
    file_sizes,
    load_plain_state,
)
from dsl_lit.checkpoint.integrity import ALGORITHM, checksum_problem, checksums, recorded_checksums
from dsl_lit.checkpoint.sharded import (
    drop_tensor_markers,
    insert_tensors,
    load_shards,
    missing_tensors,
    read_full_tensors,
    save_shards,
    split_tensors,
)
from dsl_lit.checkpoint.tokenizer import META_KEY as TOKENIZER_KEY
from dsl_lit.checkpoint.tokenizer import checkpoint_record, copy_into_checkpoint
from dsl_lit.models.common.hf_adapter import few

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
_WRITTEN = re.compile(r"^step-(\d+)(?:-v(\d+))?$")
# Hidden leftovers of an interrupted write or removal (ours, or publish_dir's trash): never read, swept.
_LEFTOVER = re.compile(r"^\.(tmp-step-\d+|removing-step-\d+-[0-9a-f]+|step-\d+\.old-.*)$")


def _fsync_tree(root: Path) -> None:
    """Flush the files and directories to disk, so the rename publishes data that survives a crash."""
    for path in sorted(root.rglob("*"), reverse=True):  # files before the directories holding them
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
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


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(N, path)`` of every ``step-<N>`` directory under ``root``, newest first (none if no ``root``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        ((int(m.group(1)), child) for child in root.iterdir() if (m := STEP_DIR.match(child.name)) and child.is_dir()),
        reverse=True,
    )


def prune_checkpoints(root: Path, keep_last: int | None, keep: Path | None = None) -> list[Path]:
    """Remove the step directories we wrote beyond the ``keep_last`` newest (by step); ``keep`` (the
    one just written) always stays. ``keep_last`` 0 or None keeps all.

    Every directory holding our ``meta.json`` counts, also one damaged since, and also the
    ``step-<N>-v<K>`` that Lightning's name versioning made of a re-saved step before this project
    turned it off (they were ours; resume never reads them). A ``step-<N>`` without ``meta.json``
    may not be ours, so it is left alone (``latest_checkpoint`` skips it). Hidden leftovers of
    interrupted writes and removals are swept. Returns the removed directories."""
    root = Path(root)
    for child in root.iterdir():
        if _LEFTOVER.match(child.name):
            shutil.rmtree(child, ignore_errors=True)
    if not keep_last:
        return []
    ours = sorted(
        (int(m.group(1)), int(m.group(2) or 0), child) for child in root.iterdir()
        if (m := _WRITTEN.match(child.name)) and child.is_dir() and (child / META).is_file()
    )
    keep_resolved = Path(keep).resolve() if keep is not None else None
    others = [child for _, _, child in ours if child.resolve() != keep_resolved]
    room = keep_last - (1 if keep_resolved is not None and len(others) < len(ours) else 0)
    removed = others[: max(len(others) - room, 0)]  # oldest first
    for child in removed:
        remove_dir(child)
        log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", child, keep_last)
    return removed


def no_usable_checkpoint(root: Path, failures: list[str]) -> ConfigError:
    """The error of a run whose checkpoints all fail (``failures``: ``step-<N>: why``): it stops
    rather than silently training from step 0 again, and says how to start afresh on purpose."""
    return ConfigError(
        f"no checkpoint under {root} can be resumed from ({'; '.join(failures)}). Rerun with "
        "checkpoint.resume=false to train from step 0 (its checkpoints replace these step directories), or "
        "resume another checkpoint with checkpoint.resume_from=<run dir>/checkpoints/step-<N>"
    )


def previous_checkpoints(path: Path) -> list[Path]:
    """The ``step-<M>`` directories beside ``path`` (a ``step-<N>``) with M < N, newest first: what a
    resume falls back to when ``path`` fails."""
    path = Path(path)
    m = STEP_DIR.match(path.name)
    if m is None:
        return []
    return [child for n, child in step_dirs(path.parent) if n < int(m.group(1))]


class DirectoryCheckpointIO(CheckpointIO):
    """Writes and reads ``step-<N>`` directories; with ``async_save`` the write runs in the background.

    Every rank calls ``save_checkpoint`` with its own part of the checkpoint (the strategy sets
    ``rank`` and ``process_group``; one process needs neither). It first waits for the previous save
    (at most one in flight; an error of that write is raised here). ``teardown`` (end of ``fit``,
    also after an exception) waits for the write in flight.
    """

    def __init__(self, resolved_config: dict[str, Any] | None = None, async_save: bool = False,
                 keep_last: int | None = None, fall_back: bool = True) -> None:
        self.resolved_config = resolved_config or {}
        self.async_save = async_save
        self.keep_last = keep_last or None
        self.fall_back = fall_back
        """Whether a checkpoint that fails to load is replaced by the previous step directory beside
        it (a run resuming its own latest) or is an error (a checkpoint the user named)."""
        self.rank = 0
        self.process_group: dist.ProcessGroup | None = None
        """Collectives of saving and loading: a group of their own, so a background save never
        interleaves with training's collectives on the same group."""
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    # -- saving ----------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        self.wait()
        final = Path(path)
        tmp = final.with_name(f".tmp-{final.name}")
        start = time.perf_counter()
        plain, tensors = split_tensors(checkpoint)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                (tmp / SHARDS).mkdir(parents=True)
                torch.save(plain, tmp / STATE)
                (tmp / CONFIG).write_text(yaml.safe_dump(self.resolved_config, sort_keys=False))
                copy_into_checkpoint(final.parent.parent, tmp)  # the run's tokenizer (<run dir>/tokenizer), if recorded
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        if self.process_group is not None:
            dist.barrier(group=self.process_group)  # the directory exists before any rank writes into it
        written = save_shards(tensors, tmp / SHARDS, self.process_group, asynchronous=self.async_save)
        if not self.async_save:
            if self.rank == 0:
                self._publish(tmp, final, start, checkpoint.get("global_step"))
            return
        if self.rank != 0:
            self._pending = written
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-publisher")
        self._pending = self._executor.submit(self._publish, tmp, final, start, checkpoint.get("global_step"), written)

    def _publish(self, tmp: Path, final: Path, start: float, global_step: int | None,
                 written: Future | None = None) -> None:
        """Rank 0, once every rank's shards are written: ``meta.json``, flush, rename ``.tmp-step-<N>``
        to ``step-<N>``, prune older ones. On failure the temporary directory is removed."""
        try:
            if written is not None:
                written.result()  # DCP returns on rank 0 only after every rank reported its writes
            files = file_sizes(tmp)
            hashing = time.perf_counter()
            meta = {"global_step": global_step, "complete": True, "files": files,
                    "checksum": ALGORITHM, "checksums": checksums(tmp, list(files))}
            tokenizer = checkpoint_record(tmp)
            if tokenizer is not None:
                meta[TOKENIZER_KEY] = tokenizer
            hashing = time.perf_counter() - hashing
            (tmp / META).write_text(json.dumps(meta, indent=1))
            _fsync_tree(tmp)
            publish_dir(tmp, final)
        except BaseException:
            log.exception("writing checkpoint %s failed", final)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("checkpoint %s written in %.2f s%s (checksums of %.0f MiB: %.3f s)", final,
                 time.perf_counter() - start, " (in the background)" if written is not None else "",
                 sum(files.values()) / (1 << 20), hashing)
        if STEP_DIR.match(final.name):
            prune_checkpoints(final.parent, self.keep_last, keep=final)

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; re-raise its error."""
        pending, self._pending = self._pending, None
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
    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None,
        template: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict. With a ``template`` (the strategy's own checkpoint of this run, in its
        layout), its tensors are filled in place with just the shards this rank holds; without one
        (one process, no layout), every tensor is read whole.

        Before anything is used, every file is checked against the checksum ``meta.json`` recorded
        (the files shared out among the ranks). A checkpoint that fails a check or does not load (a
        ``trainer_state.pt`` that does not unpickle weights-only, a tensor of the model or optimizer
        missing from the shards) is skipped with a warning naming the file, and the previous step
        directory beside it is tried, unless ``fall_back`` is off; every rank reaches the same verdict.
        ConfigError naming the directory and how to start afresh when none loads."""
        self.wait()
        path = Path(path)
        candidates = [path, *previous_checkpoints(path)] if self.fall_back else [path]
        failures: list[str] = []
        for candidate in candidates:
            try:
                return self._load_verified(candidate, template)
            except CorruptCheckpoint as err:
                if not self.fall_back:
                    raise ConfigError(f"checkpoint {path} cannot be resumed from: {err}; name another step "
                                      "directory in checkpoint.resume_from") from None
                failures.append(f"{candidate.name}: {err}")
                if self.rank == 0:
                    log.warning("skipping corrupt checkpoint %s: %s", candidate, err)
        raise no_usable_checkpoint(path.parent, failures)

    def _load_verified(self, path: Path, template: dict[str, Any] | None) -> dict[str, Any]:
        self._agree(checkpoint_problem(path))  # cheap: sizes, headers, meta.json
        names = sorted(recorded_checksums(path))
        if not names and self.rank == 0:
            log.info("%s was written before checksums were recorded: checked by file sizes only", path)
        if self.process_group is not None:  # each rank hashes its share of the files
            names = names[dist.get_rank(self.process_group)::dist.get_world_size(self.process_group)]
        self._agree(checksum_problem(path, names))
        if template is None:
            return self._read_whole(path)
        problem, state, wanted, missing = None, {}, {}, []
        try:
            state = drop_tensor_markers(load_plain_state(path))
            _, wanted = split_tensors(template)
            missing = missing_tensors(wanted, path / SHARDS)
            required = [k for k in missing if k.startswith(("state_dict/", "optimizer_states/"))]
            if required:
                problem = f"{SHARDS}/ lacks {few(required)} (renamed or removed tensors)"
        except CorruptCheckpoint as err:
            problem = str(err)
        except Exception as err:  # unreadable safetensors headers, a tensor of another shape
            problem = f"{SHARDS}/ does not match this run: {err}"
        self._agree(problem)  # every rank, before the collective load below
        present = {k: v for k, v in wanted.items() if k not in missing}
        try:
            load_shards(present, path / SHARDS, self.process_group)
        except Exception as err:
            if self.process_group is not None and not isinstance(err, CheckpointException):
                raise  # not DCP's own (raised on every rank): retrying on one rank would hang the others
            raise CorruptCheckpoint(f"{SHARDS}/ does not load ({err})") from None
        return insert_tensors(state, present)

    def _read_whole(self, path: Path) -> dict[str, Any]:
        """One process: the plain state and every tensor, whole."""
        state = drop_tensor_markers(load_plain_state(path))
        try:
            tensors = read_full_tensors(path / SHARDS)
        except Exception as err:  # safetensors and DCP raise several kinds
            raise CorruptCheckpoint(f"{SHARDS}/ does not load ({err})") from None
        return insert_tensors(state, tensors)

    def _agree(self, problem: str | None) -> None:
        """Raise CorruptCheckpoint on every rank if any rank found ``problem`` (each checks its part)."""
        problems = [problem]
        if self.process_group is not None:
            problems = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(problems, problem, group=self.process_group)
        first = next((p for p in problems if p), None)
        if first is not None:
            raise CorruptCheckpoint(first)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        self.wait()
        remove_dir(Path(path))


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
            enable_version_counter=False,  # re-saving a step replaces its directory, never a step-<N>-v1 beside it
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


def latest_checkpoint(checkpoint_dir: str | os.PathLike, verify: bool = False) -> Path | None:
    """The usable ``step-<N>`` directory with the largest N. Incomplete or corrupt ones (no
    ``meta.json``, a missing or truncated shard or ``trainer_state.pt``; with ``verify`` also a file
    that does not match its checksum) are skipped with a warning naming them; hidden temporary
    directories of unfinished writes are ignored. Resuming verifies checksums when it loads (the
    ranks share the work), so it asks without ``verify``; one-process readers (the HF export) ask with."""
    for _, child in step_dirs(Path(checkpoint_dir)):
        problem = checkpoint_problem(child)
        if problem is None and verify:
            problem = checksum_problem(child)
        if problem is None:
            return child
        log.warning("skipping incomplete or corrupt checkpoint %s: %s", child, problem)
    return None
