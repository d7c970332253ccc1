"""``PretrainDataModule``: corpus -> (data pipeline) tokenizer and packed shards -> one global batch per step.

Why one batch per OPTIMIZER step: the LightningModule (or the pipeline schedule) cuts it into
micro-batches itself, so gradient accumulation and pipeline parallelism never change which samples
make a step. The sampler is ours (run the Trainer with ``use_distributed_sampler=False``): it is
keyed on the global sample position, so resuming, even under a different data-parallel size,
repeats and skips nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from data_contract.errors import ConfigError
from data_contract.format import META_FILE, SHARDS_DIR, TOKENIZER_DIR
from dsl_lit.config.data import DataConfig
from dsl_lit.data.cache import build_dir, prepare_cache
from dsl_lit.data.packed import PackedTokens
from dsl_lit.data.sampler import GlobalBatchSampler, num_windows

log = logging.getLogger(__name__)


class PackedWindows(Dataset):
    """Map-style view of window ``i`` = tokens ``[i*seq_len, i*seq_len + seq_len + 1)``."""

    def __init__(self, tokens: PackedTokens, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_windows = num_windows(len(tokens), seq_len)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} outside [0, {self.num_windows})")
        return self.tokens.window(index * self.seq_len, self.seq_len + 1).astype(np.int64)


def collate_windows(windows: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Stack windows into next-token pairs: labels are the inputs shifted left by one."""
    stacked = torch.from_numpy(np.stack(windows))
    return {"input_ids": stacked[:, :-1].contiguous(), "labels": stacked[:, 1:].contiguous()}


class PretrainDataModule(L.LightningDataModule):
    """Builds (once, under a file lock) and serves the packed pretraining stream."""

    def __init__(self, cfg: DataConfig | Mapping[str, Any]) -> None:
        super().__init__()
        self.cfg = DataConfig.coerce(cfg).validate()
        self.consumed_samples = 0
        self._start_step: int | None = None  # trainer.global_step when the train loader was built
        self.tokens: PackedTokens | None = None
        self.num_windows = 0
        self.train_windows = 0

    # -- where things live --------------------------------------------------------------------
    @cached_property
    def build(self) -> Path:
        """The directory of this data config's tokenizer/ and shards/ (``dsl_lit.data.cache.build_dir``),
        fixed once read, so that a run sharing ``cache_dir`` with other settings keeps its own."""
        return build_dir(self.cfg)

    @property
    def tokenizer_dir(self) -> Path:
        return self.build / TOKENIZER_DIR

    @property
    def shards_dir(self) -> Path:
        return self.build / SHARDS_DIR

    @cached_property
    def tokenizer_meta(self) -> dict[str, Any]:
        """``vocab_size``, ``padded_vocab_size`` (the model's embedding rows), ``bos_id``, ``eos_id``, ``pad_id``."""
        path = self.tokenizer_dir / META_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: call prepare_data() first")
        return json.loads(path.read_text(encoding="utf-8"))

    # -- building -----------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Build the tokenizer and the packed shards with the data pipeline unless ``cache_dir``
        already holds a matching build (``dsl_lit.data.cache``); concurrent callers wait for one."""
        prepare_cache(self.cfg)
        for name in ("build", "tokenizer_meta"):  # drop values read before the build existed
            self.__dict__.pop(name, None)

    # -- serving ------------------------------------------------------------------------------
    def dp_coordinates(self) -> tuple[int, int]:
        """(dp_rank, dp_size): those of the step runner the strategy hands the module
        (``dsl_lit.parallel.step_runner``: tp and pp ranks share data), else the trainer's global
        rank and world size, else (0, 1). (The data layer sits below ``parallel``: it reads the
        runner through the strategy's ``step_runner`` attribute, the documented hook.)"""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        runner = getattr(trainer.strategy, "step_runner", None)
        if runner is not None:
            return int(runner.dp_rank), int(runner.dp_size)
        return int(trainer.global_rank), int(trainer.world_size)

    def setup(self, stage: str | None = None) -> None:
        if self.tokens is not None:
            return
        self.cfg.validate(dp_size=self.dp_coordinates()[1])
        self.tokens = PackedTokens(self.shards_dir)
        if self.tokens.meta["padded_vocab_size"] != self.tokenizer_meta["padded_vocab_size"]:
            raise RuntimeError(f"{self.shards_dir} was built with another tokenizer: delete it and rerun")
        self.num_windows = num_windows(len(self.tokens), self.cfg.seq_len)
        self.train_windows = self.num_windows - self.cfg.val_windows
        if self.train_windows < self.cfg.global_batch_size:
            raise ConfigError(
                f"data.val_windows={self.cfg.val_windows} leaves {self.train_windows} of {self.num_windows} windows "
                f"for training, fewer than data.global_batch_size={self.cfg.global_batch_size}; lower it"
            )
        log.info(
            "data: %d tokens, %d documents, %d windows of %d tokens",
            len(self.tokens),
            self.tokens.num_documents,
            self.num_windows,
            self.cfg.seq_len,
        )

    def batch_sampler(self) -> GlobalBatchSampler:
        dp_rank, dp_size = self.dp_coordinates()
        return GlobalBatchSampler(
            self.train_windows,
            self.cfg.global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=self.cfg.seed,
            consumed_samples=self.consumed_samples,
            batch_size_at=self.cfg.batch_schedule.size_at,
        )

    def train_dataloader(self) -> DataLoader:
        """One batch per optimizer step for this rank: ``input_ids`` and ``labels`` of shape
        ``[global_batch_size // dp_size, seq_len]``, starting at ``consumed_samples``."""
        if self.tokens is None:
            self.setup("fit")
        assert self.tokens is not None
        if self.trainer is not None:
            if self._start_step is not None:  # rebuilt mid-run: continue where the last loader got to
                self.consumed_samples = self.state_dict()["consumed_samples"]
            self._start_step = int(self.trainer.global_step)
        return DataLoader(
            PackedWindows(self.tokens, self.cfg.seq_len),
            batch_sampler=self.batch_sampler(),
            collate_fn=collate_windows,
            num_workers=self.cfg.num_workers,
            persistent_workers=self.cfg.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        """The held-out windows (the last ``data.val_windows``), in order, as batches of
        ``data.val_batch_size`` (default: the global batch) of which this rank takes its contiguous
        slice: every layout validates on the same samples."""
        if self.tokens is None:
            self.setup("validate")
        dp_rank, dp_size = self.dp_coordinates()
        size = self.cfg.validation_batch
        share = size // dp_size
        batches = [
            list(range(start + dp_rank * share, start + (dp_rank + 1) * share))
            for start in range(self.train_windows, self.num_windows - size + 1, size)
        ]
        return DataLoader(
            PackedWindows(self.tokens, self.cfg.seq_len), batch_sampler=batches, collate_fn=collate_windows
        )

    # -- resumption ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Samples consumed so far: exact, since one training step consumes one global batch.

        Counted from where this run's loader started (``global_step * global_batch_size`` for a run
        that never changed its batch size), so a resume with a new batch size stays exact.
        """
        consumed = self.consumed_samples
        if self.trainer is not None:
            start_step = self._start_step if self._start_step is not None else 0
            start = self.consumed_samples if self._start_step is not None else 0
            consumed = self.cfg.batch_schedule.advance(start, int(self.trainer.global_step) - start_step)
        return {
            "consumed_samples": consumed,
            "global_batch_size": self.cfg.global_batch_size,
            "seq_len": self.cfg.seq_len,
            "seed": self.cfg.seed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``consumed_samples``; the next ``train_dataloader()`` starts there."""
        for key in ("seq_len", "seed"):
            if key in state_dict and state_dict[key] != getattr(self.cfg, key):
                log.warning(
                    "data: resuming with data.%s=%s but the checkpoint used %s: the sample order changes",
                    key,
                    getattr(self.cfg, key),
                    state_dict[key],
                )
        self.consumed_samples = int(state_dict["consumed_samples"])
