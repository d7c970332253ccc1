"""One strategy for every world size: a one-process run under ``DeepSeekStrategy`` starts no
process group and launches nothing, steps through the mesh runner with every dimension 1 (the
runner of every other layout), and a layout validated for another world size is refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.models import ModelConfig
from dsl_lit.parallel.step_runner import MeshStepRunner, PipelineStepRunner
from dsl_lit.parallel.strategy import ONE_PROCESS, DeepSeekStrategy
from dsl_lit.training import PretrainModule
from tests.numerics import assert_close_fp32


def _module() -> PretrainModule:
    cfg = ModelConfig.from_name("deepseek_llm_tiny", vocab_size=128, n_layers=2, d_model=64, n_heads=4,
                                n_kv_heads=2, ffn_hidden=96)
    return PretrainModule(cfg, OptimConfig(lr=1e-2), ScheduleConfig(name="constant", warmup_steps=0), 4, total_steps=2)


def _batches(steps: int) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 128, (steps, 8, 17), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


class _Seen(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        strategy = trainer.strategy
        self.seen = dict(process_group=dist.is_available() and dist.is_initialized(), launcher=strategy.launcher,
                         runner=type(strategy.step_runner), mesh=strategy.mesh, world=trainer.world_size,
                         dp=(strategy.step_runner.dp_rank, strategy.step_runner.dp_size))


def _trainer(strategy: DeepSeekStrategy, steps: int, callbacks=(), devices: int = 1) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, callbacks=list(callbacks))


def test_one_process_starts_no_process_group_and_steps_through_the_mesh_runner():
    seen = _Seen()
    torch.manual_seed(0)
    module = _module()
    trainer = _trainer(DeepSeekStrategy(), 1, [seen])
    trainer.fit(module, train_dataloaders=DataLoader(_batches(1), batch_size=None))
    assert trainer.global_step == 1
    assert seen.seen == dict(process_group=False, launcher=None, runner=MeshStepRunner, mesh=None, world=1, dp=(0, 1))
    assert ONE_PROCESS.world_size == 1 and not ONE_PROCESS.shards_model
    # the step's loss and gradient norm are those of a plain loop over the same 2 micro-batches
    torch.manual_seed(0)
    reference = _module()
    reference.configure_model()
    batch, loss = _batches(1)[0], torch.zeros(())
    for rows in (slice(0, 4), slice(4, 8)):
        logits = reference.model(batch["input_ids"][rows])
        part = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][rows].flatten()) / 2
        part.backward()
        loss += part.detach()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.model.parameters()]))
    logged = trainer.callback_metrics
    tokens = 8 * 16  # the longest sum behind the loss and the norm
    assert_close_fp32(logged["train/loss"], loss, tokens)
    assert_close_fp32(logged["train/grad_norm"], norm, tokens * 64)


def test_a_layout_for_another_world_size_is_refused_before_any_step():
    two = ParallelLayout(world_size=2, dp=2)
    with pytest.raises(RuntimeError, match=r"^the layout was validated for 1 processes, Lightning started 2$"):
        _trainer(DeepSeekStrategy(), 1, devices=2).fit(_module(), train_dataloaders=DataLoader(_batches(1), batch_size=None))
    assert not (dist.is_available() and dist.is_initialized())
    assert DeepSeekStrategy(two).one_process is False and DeepSeekStrategy().one_process is True
    assert PipelineStepRunner is not MeshStepRunner  # (the pipeline runner serves pp > 1 only)
