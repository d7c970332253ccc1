"""GRPO's token-mean losses over data-parallel replicas with unequal completion lengths.

``dapo`` divides every replica's token sum by the completion tokens of the *global* batch, so two
gloo processes (a real Trainer and DeepSeekStrategy each) hand the optimizer the gradient of one
process on the whole batch; ``bnpo`` divides by each replica's *own* tokens (TRL's per-process
batch), so its gradient is the mean of the two halves' token means, which differs from one process
when one replica's completions are longer. On one process the two coincide, which is why the loss
function's own tests (tests/unit/posttrain/test_objectives.py) cannot tell them apart: the difference lives in
``GRPOModule.loss_normalizers``. Sampling and rewards are tested in tests/unit/posttrain/test_grpo.py and the
recipe in tests/e2e/recipes/test_posttrain_recipes.py; the rows here are fixed completions.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.config.posttrain import GRPOConfig
from dsl_lit.parallel.strategy import DeepSeekStrategy
from dsl_lit.posttrain import GRPOModule
from dsl_lit.posttrain.module import PostTrainModule, shifted_completion
from dsl_lit.posttrain.rewards import WeightedRewards
from tests.numerics import assert_close_fp32, relative_error
from tests.ranks import free_port, spawn
from tests.unit.training.test_objective_references import StepRecorder
from tests.unit.training.test_pretrain_module import _llm

PROMPT, WIDTH = 6, 18
LENGTHS = [[2, 4, 3, 1], [12, 14, 9, 13]]
"""Completion lengths on rank 0 and rank 1: rank 1's replies are ~4x longer."""


class CompletionsGRPO(GRPOModule):
    """GRPO's objective on completions given as rows: the optimizer step of ``GRPOModule`` after
    its rollout (which samples, so two layouts could not be handed the same completions)."""

    def training_step(self, batch, batch_idx):
        return PostTrainModule.training_step(self, batch, batch_idx)


def _rows(rank: int) -> dict[str, torch.Tensor]:
    """A rollout's training rows for one rank: prompt, completion of the given length, padding."""
    generator = torch.Generator().manual_seed(rank)
    sequences = torch.randint(3, 128, (4, PROMPT + WIDTH), generator=generator)
    valid = torch.ones_like(sequences, dtype=torch.bool)
    for row, length in enumerate(LENGTHS[rank]):
        valid[row, PROMPT + length :] = False
        sequences[row, PROMPT + length :] = 0
    rows = shifted_completion(sequences, valid, PROMPT)
    rows["advantages"] = torch.randn(4, generator=generator)
    return rows


def _all_rows() -> dict[str, torch.Tensor]:
    halves = [_rows(0), _rows(1)]
    return {k: torch.cat([h[k] for h in halves]) for k in halves[0]}


def _module(loss_type: str) -> CompletionsGRPO:
    torch.manual_seed(0)
    grpo = GRPOConfig(group_size=4, beta=0.0, loss_type=loss_type).validate()
    return CompletionsGRPO(_llm(), OptimConfig(lr=1e-3, grad_clip=0.0), ScheduleConfig(name="constant", warmup_steps=0),
                           micro_batch_size=2, total_steps=1, grpo=grpo, rewards=WeightedRewards({"accuracy": 1.0}),
                           problems=[], tokenizer=None)


def _fit(module: CompletionsGRPO, rows: dict[str, torch.Tensor], **trainer_kwargs) -> dict[str, torch.Tensor]:
    """One optimizer step; the gradients the optimizer was handed (reduced over replicas)."""
    recorder = StepRecorder()
    trainer_kwargs.setdefault("strategy", DeepSeekStrategy())
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[recorder], **trainer_kwargs)
    trainer.fit(module, train_dataloaders=DataLoader([rows], batch_size=None))
    return recorder.grads[0]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """One of two processes started as a launcher would (Lightning's environment variables)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    grads = {}
    for loss_type in ("dapo", "bnpo"):
        strategy = DeepSeekStrategy(ParallelLayout(world_size=world, dp=world))
        grads[loss_type] = _fit(_module(loss_type), _rows(rank), devices=world, strategy=strategy)
    torch.save(grads, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
def test_dapo_normalises_by_the_global_batch_and_bnpo_by_each_replica(tmp_path):
    spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    whole = _fit(_module("dapo"), _all_rows())  # one process, all 8 completions
    halves = [_fit(_module("bnpo"), _rows(r)) for r in range(2)]  # one process on each replica's rows
    assert torch.equal(_fit(_module("bnpo"), _all_rows())["output.weight"], whole["output.weight"])  # 1 process: same
    tokens = sum(map(sum, LENGTHS))
    for name, expected in whole.items():
        for rank in ranks:
            assert_close_fp32(rank["dapo"][name], expected, tokens, msg=f"dapo {name}")
            assert_close_fp32(rank["bnpo"][name], (halves[0][name] + halves[1][name]) / 2, tokens, msg=f"bnpo {name}")
    # the two normalisations really differ here (rank 1 holds ~4x the tokens of rank 0)
    assert relative_error(ranks[0]["bnpo"]["output.weight"], whole["output.weight"]) > 0.1
