"""Rejection sampling as Lightning's predict loop, so it launches like every recipe
(``trainer.devices=N``, ``trainer.num_nodes=M``, the same precision plugin).

Each process holds the whole model (sampling needs no gradient or optimizer state to shard) and
samples its share of the prompt batches: batch b of ``rejection.batch_prompts`` consecutive problems
goes to process b mod N. Every batch's generator is seeded by its first problem, so the kept
samples are the same for any N. At the end the records are gathered, in problem order, on every
process; the recipe's rank 0 writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from dsl_lit.config.posttrain import RejectionConfig
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.posttrain.rejection.data import RejectionSampler, RejectionStats, batch_generator
from dsl_lit.training.pretrained import StartingWeights


class RejectionSamplingModule(L.LightningModule):
    def __init__(
        self,
        model_config: ModelConfig,
        initial_state: StartingWeights | None,
        tokenizer: ChatTokenizer,
        problems: Sequence[dict[str, Any]],
        prompt_of: Callable[[dict[str, Any]], list[dict[str, str]]],
        cfg: RejectionConfig,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.model_config, self.initial_state = model_config, initial_state
        self.sampler = RejectionSampler(tokenizer, prompt_of, cfg)
        self.problems, self.seed = list(problems), seed
        self.model: torch.nn.Module | None = None
        self._batches: list[tuple[int, list[dict[str, Any]]]] = []
        self._stats = RejectionStats()
        self.records: list[dict[str, Any]] = []
        """Every process's kept records, in problem order (after the predict loop)."""
        self.stats = RejectionStats()
        """Counts summed over processes (after the predict loop)."""

    def configure_model(self) -> None:
        if self.model is None:
            if self.initial_state is None:
                torch.manual_seed(self.seed)  # a random start is the same model in every process
                self.model = build_model(self.model_config)
            else:  # every process samples with the whole model
                self.model = self.initial_state.whole_model(torch.get_default_device())
                self.initial_state = None
            self.model.eval().requires_grad_(False)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        indices = batch["index"].tolist()
        records = self.sampler.sample_batch(self.model, [self.problems[i] for i in indices], self._stats,
                                            batch_generator(self.device, self.seed, indices[0]))
        self._batches.append((indices[0], records))

    def on_predict_epoch_end(self) -> None:
        mine = (self._batches, self._stats)
        everyone: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        batches = sorted(b for process_batches, _ in everyone for b in process_batches)
        self.records = [record for _, records in batches for record in records]
        self.stats = sum((stats for _, stats in everyone), RejectionStats())
