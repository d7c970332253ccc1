"""How one optimizer step runs on a layout: the contract between a LightningModule and the Strategy.

The module knows its objective; the Strategy knows the layout. They meet here, in two small
protocols, so neither names the other:

- :class:`StepModule` is what a runner asks of the module: the model, the micro-batch size, the
  loss of a micro-batch (from the model's outputs, so a pipeline's last stage can call it too), the
  per-row inputs every pipeline stage needs, and the fp16 loss scale.
- :class:`StepRunner` is what the module asks of the layout: run the step's forwards and
  backwards, reduce counts over the replicas that see different tokens (dp x cp), give this rank's
  share of a sequence (context parallelism), finish (reduce + clip) the gradients, build the
  optimizer, gather the whole model. :func:`step_runner_of` returns the Strategy's runner, or
  :class:`LocalStepRunner` for a strategy without one (one device, Lightning's own strategies).

The Strategy's runners are :class:`MeshStepRunner` (micro-batches in a loop, gradients reduced once
per step from backward hooks) and :class:`PipelineStepRunner` (a ``torch.distributed.pipelining``
schedule owns the forwards and backwards). Both give one process's losses on the same global batch.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from dsl_lit.config.optim import OptimConfig
from dsl_lit.optim import build_optimizer
from dsl_lit.optim.clip import clip_grad_norm_
from dsl_lit.parallel.context_parallel import ContextParallelKeys
from dsl_lit.parallel.pipeline_inference import PipelinedInference

if TYPE_CHECKING:
    from dsl_lit.parallel.strategy import DeepSeekStrategy

Batch = dict[str, torch.Tensor]
Metrics = dict[str, torch.Tensor]


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Split every tensor of ``batch`` along dim 0 into chunks of ``micro_batch_size`` rows."""
    size = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)]


@runtime_checkable
class StepModule(Protocol):
    """What a step runner needs of a LightningModule (``CausalLMModule`` implements it)."""

    model: nn.Module
    micro_batch_size: int

    @property
    def loss_scale(self) -> float:
        """Multiplier of the objective before backward (fp16 loss scaling; 1.0 otherwise)."""

    @property
    def trains_mtp(self) -> bool:
        """Whether the objective reads the MTP modules' logits (a pipeline's last stage runs them)."""

    def micro_batch_loss(self, micro_batch: Batch, normalizers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        """Run the model on one micro-batch: (objective incl. auxiliary losses, detached metrics)."""

    def micro_batch_objective(self, micro_batch: Batch, normalizers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        """Same without auxiliary losses (validation)."""

    def loss_from_outputs(
        self, outputs: tuple[torch.Tensor, ...], micro_batch: Batch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        """The objective from the model's outputs (logits, MTP logits): a pipeline's last stage calls it."""

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-row model inputs besides token ids (positions, key_valid) that every stage receives."""

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Lightning's backward (precision plugin hooks included)."""

    def load_initial_weights(self, device: torch.device) -> None:
        """Read the starting weights into the model it left on the meta device (the strategy calls
        it after pruning and sharding the model, so each rank reads only its own tensors)."""


class LocalStepRunner:
    """The step on a strategy without a device mesh: micro-batches in a loop, autograd accumulating
    gradients; data-parallel replicas (a plain Lightning multi-process strategy) reduce through the
    strategy."""

    shards_model = False

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy

    @property
    def dp_size(self) -> int:
        return int(getattr(self.strategy, "world_size", 1) or 1)

    @property
    def dp_rank(self) -> int:
        return int(getattr(self.strategy, "global_rank", 0) or 0)

    @property
    def replicas(self) -> int:
        """Ranks whose gradients are averaged (data-parallel replicas x context-parallel ranks)."""
        return self.dp_size

    def context_keys(self, seq_len: int, device: torch.device) -> ContextParallelKeys | None:
        """This rank's share of a forward over ``seq_len`` positions; None: it runs them all."""
        return None

    def loss_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def before_last_backward(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Hook before the step's last backward (gradient-reduction overlap arms here)."""

    def run(self, module: StepModule, batch: Batch, normalizers: dict, backward: bool = True) -> Metrics:
        """One step's forwards (and backwards); returns this rank's metrics summed over micro-batches."""
        totals: Metrics = {}
        micro_batches = split_micro_batches(batch, module.micro_batch_size)
        with self.loss_context():
            for i, micro_batch in enumerate(micro_batches):
                if not backward:
                    metrics = module.micro_batch_objective(micro_batch, normalizers)[1]
                else:
                    objective, metrics = module.micro_batch_loss(micro_batch, normalizers)
                    if i == len(micro_batches) - 1:
                        self.before_last_backward(module.model, module.optimizers().optimizer)
                    module.manual_backward(objective * module.loss_scale)
                for name, value in metrics.items():
                    totals[name] = totals.get(name, 0.0) + value
        return totals

    def reduce_over_replicas(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        """Reduce a count over the ranks that see different tokens (see :attr:`replicas`)."""
        if self.replicas == 1:
            return tensor
        return self.strategy.reduce(tensor, reduce_op=reduce_op)

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        return build_optimizer(model, cfg)

    def finish_gradients(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """Clip by the global norm (unscaling fp16 gradients in the same pass); returns the norm."""
        return clip_grad_norm_(model.parameters(), max_norm, loss_scale=loss_scale)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def generation_group(self, same_calls_on_every_replica: bool = True) -> dist.ProcessGroup | None:
        """The ranks that sample from the sharded model together (None: a rank holds the whole model,
        or samples from a whole copy of it); see ``DeepSeekStrategy.generation_group``."""
        return None

    def inference_view(self, model: nn.Module) -> nn.Module | PipelinedInference:
        """``model`` (the policy, or a frozen copy of it) as generation and frozen log-probs run it
        on this layout: itself, or chained through the pipeline stages it was cut to."""
        return model


class MeshStepRunner(LocalStepRunner):
    """The step on :class:`~dsl_lit.parallel.strategy.DeepSeekStrategy`'s mesh without pipeline
    stages: the vocab-parallel loss under tp, the overlapped dp reduction armed before the last
    backward; everything layout-specific is the strategy's."""

    def __init__(self, strategy: DeepSeekStrategy) -> None:
        super().__init__(strategy)

    @property
    def shards_model(self) -> bool:  # type: ignore[override]
        return self.strategy.shards_model

    @property
    def dp_size(self) -> int:
        return self.strategy.dp_size

    @property
    def dp_rank(self) -> int:
        return self.strategy.dp_rank

    @property
    def replicas(self) -> int:
        return self.strategy.replicas

    def context_keys(self, seq_len: int, device: torch.device) -> ContextParallelKeys | None:
        return self.strategy.context_keys(seq_len, device)

    def loss_context(self) -> contextlib.AbstractContextManager:
        return self.strategy.loss_context()

    def before_last_backward(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.strategy.before_last_backward(model, optimizer)

    def reduce_over_replicas(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        return self.strategy.reduce_over_replicas(tensor, reduce_op)

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        return self.strategy.build_optimizer(model, cfg)

    def finish_gradients(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None, loss_scale: float = 1.0
    ) -> torch.Tensor:
        return self.strategy.finish_gradients(model, optimizer, max_norm, loss_scale)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.strategy.full_state_dict(model) if self.shards_model else model.state_dict()

    def generation_group(self, same_calls_on_every_replica: bool = True) -> dist.ProcessGroup | None:
        return self.strategy.generation_group(same_calls_on_every_replica)


class PipelineStepRunner(MeshStepRunner):
    """The step through the strategy's pipeline schedule: each rank runs its stages' forwards and
    backwards over the step's micro-batches; the last stage computes the module's own objective
    on its micro-batch's rows. Metrics are summed over stages (the loss from the last stage,
    balance losses from where their MoE layers are), the same on every pipeline rank."""

    def __init__(self, strategy: DeepSeekStrategy) -> None:
        super().__init__(strategy)
        self._metric_names: dict[str, list[str]] = {}
        self._module: StepModule | None = None
        self._batch: Batch | None = None
        self._normalizers: dict | None = None
        self._totals: Metrics = {}

    def run(self, module: StepModule, batch: Batch, normalizers: dict, backward: bool = True) -> Metrics:
        pipeline = self.strategy.pipeline
        rows = batch["input_ids"].shape[0]
        pipeline.build_schedule(rows // module.micro_batch_size, self._last_stage_loss)
        self._module, self._normalizers, self._batch, self._totals = module, normalizers, batch, {}
        row_ids = torch.arange(rows, device=batch["input_ids"].device)  # the loss reads its rows' fields
        try:
            with self.loss_context():
                pipeline.step(batch["input_ids"], row_ids, float(rows), backward=backward,
                              loss_scale=module.loss_scale, inputs=module.model_inputs(batch))
            totals: Metrics = dict(self._totals)
        finally:
            self._module = self._normalizers = self._batch = None
        balance = pipeline.balance_total()
        if balance is not None:
            totals["balance_loss"] = balance
        return self._sum_over_stages(totals, "train" if backward else "val")

    def inference_view(self, model: nn.Module) -> nn.Module | PipelinedInference:
        pipeline = self.strategy.pipeline
        if isinstance(model, PipelinedInference) or not pipeline.holds_stages_only(model):  # or a whole copy
            return model
        return PipelinedInference(model, pipeline.stage_layers, pipeline.owner, self.strategy.pp_group)

    def _sum_over_stages(self, totals: Metrics, kind: str) -> Metrics:
        group = self.strategy.pp_group
        if kind not in self._metric_names:  # which metrics exist is agreed once per kind
            names: list[Any] = [None] * self.strategy.layout.pp
            dist.all_gather_object(names, sorted(totals), group=group)
            self._metric_names[kind] = sorted(set().union(*names))
        zero = torch.zeros((), device=self.strategy.root_device)
        values = torch.stack([totals.get(k, zero).float().reshape(()) for k in self._metric_names[kind]])
        dist.all_reduce(values, group=group)
        return dict(zip(self._metric_names[kind], values))

    def _last_stage_loss(self, outputs: tuple[torch.Tensor, ...], row_ids: torch.Tensor, record: bool) -> torch.Tensor:
        """The schedule's loss function: the module's objective on the micro-batch's rows of the
        step batch (metrics recorded except in the schedule's shape-inference pass)."""
        first, end = int(row_ids[0]), int(row_ids[-1]) + 1  # micro-batches are contiguous rows
        micro_batch = {name: value[first:end] for name, value in self._batch.items()}
        objective, metrics = self._module.loss_from_outputs(outputs, micro_batch, self._normalizers)
        objective = objective * self._module.loss_scale
        if record:
            for name, value in metrics.items():
                self._totals[name] = self._totals.get(name, 0.0) + value
        return objective


def step_runner_of(strategy: Any) -> LocalStepRunner:
    """The runner a strategy hands its module (``strategy.step_runner``), or a local one."""
    runner = getattr(strategy, "step_runner", None)
    return runner if runner is not None else LocalStepRunner(strategy)
