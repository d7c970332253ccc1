"""A DataModule over rows built in memory (SFT conversations, preference pairs, RL prompts).

Why a subclass of ``PretrainDataModule``: it keeps the same contract, one global batch per
optimizer step cut by data-parallel rank with our deterministic, resumable sampler, and the same
``consumed_samples`` state in checkpoints; only where the samples come from changes. The rows are
built by a function in every process (cheap, deterministic), so nothing is written to disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from data_contract.errors import ConfigError
from dsl_lit.config.data import DataConfig
from dsl_lit.data.datamodule import PretrainDataModule

Rows = dict[str, torch.Tensor]


class RowsDataset(Dataset):
    """Sample ``i`` = ``{key: tensor[i]}`` of tensors sharing their first dimension."""

    def __init__(self, rows: Rows) -> None:
        sizes = {v.shape[0] for v in rows.values()}
        if len(sizes) != 1:
            raise ValueError(f"rows have different lengths {sizes}")
        self.rows, self.size = rows, sizes.pop()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[index] for k, v in self.rows.items()}


class FixedBatches(Sampler[list[int]]):
    """A batch sampler over batches of indices given in advance."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def stack_rows(samples: list[dict[str, torch.Tensor]]) -> Rows:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class RowsDataModule(PretrainDataModule):
    """Serves ``build()``'s rows as global batches of ``data.global_batch_size`` samples."""

    def __init__(self, cfg: DataConfig | Mapping[str, Any], build: Callable[[], Rows],
                 collate: Callable[[list[dict[str, torch.Tensor]]], Rows] = stack_rows) -> None:
        super().__init__(cfg)
        self.build, self.collate = build, collate
        self.rows: Rows | None = None
        self.steps_per_batch = 1
        """Optimizer steps taken on each batch (GRPO's mu), for the consumed-samples count."""
        self.predict_batch_size = self.cfg.micro_batch_size
        """Rows per batch of the predict loop (sampling)."""

    def prepare_data(self) -> None:
        """Nothing to build on disk (the recipe prepared the tokenizer)."""

    def setup(self, stage: str | None = None) -> None:
        if self.rows is not None:
            return
        self.cfg.validate(dp_size=self.dp_coordinates()[1])
        self.rows = self.build()
        self.num_windows = self.train_windows = RowsDataset(self.rows).size
        if self.train_windows < self.cfg.global_batch_size:
            raise ConfigError(f"{self.train_windows} samples are fewer than data.global_batch_size="
                              f"{self.cfg.global_batch_size}; lower it or generate more data")

    def train_dataloader(self) -> DataLoader:
        if self.rows is None:
            self.setup("fit")
        if self.trainer is not None:
            if self._start_step is not None:  # rebuilt mid-run: continue where the last loader got to
                self.consumed_samples = self.state_dict()["consumed_samples"]
            self._start_step = int(self.trainer.global_step)
        return DataLoader(RowsDataset(self.rows), batch_sampler=self.batch_sampler(), collate_fn=self.collate)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.trainer is not None and self.steps_per_batch > 1:
            start_step = self._start_step if self._start_step is not None else 0
            start = self.consumed_samples if self._start_step is not None else 0
            batches = (int(self.trainer.global_step) - start_step) // self.steps_per_batch
            state["consumed_samples"] = start + batches * self.cfg.global_batch_size
        return state

    def val_dataloader(self) -> list:
        return []

    def predict_dataloader(self) -> DataLoader:
        """One pass over the rows in batches of ``predict_batch_size`` consecutive rows; batch b
        goes to data-parallel rank b mod dp, so a batch holds the same rows whatever the layout."""
        if self.rows is None:
            self.setup("predict")
        rank, size = self.dp_coordinates()
        n, width = RowsDataset(self.rows).size, self.predict_batch_size
        batches = [list(range(start, min(start + width, n))) for start in range(0, n, width)]
        return DataLoader(RowsDataset(self.rows), batch_sampler=FixedBatches(batches[rank::size]), collate_fn=self.collate)
