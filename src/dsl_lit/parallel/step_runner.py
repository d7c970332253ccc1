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
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from dsl_lit.config.optim import OptimConfig
from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.models.common.routing_replay import flip_rates, mean_flip_rate
from dsl_lit.optim import build_optimizer
from dsl_lit.optim.build import OPTIMIZERS, optimizer_groups
from dsl_lit.optim.clip import clip_grad_norm_
from dsl_lit.parallel.context_parallel import ContextParallelKeys
from dsl_lit.parallel.expert_parallel import expert_parameters
from dsl_lit.parallel.full_state import full_state_dict
from dsl_lit.parallel.grad_sync import OverlappedGradientReducer
from dsl_lit.parallel.pipeline import PipelineRunner
from dsl_lit.parallel.pipeline_inference import PipelinedInference
from dsl_lit.parallel.zero1 import ZeRO1AdamW
from dsl_lit.parallel.zero1_muon import ZeRO1Muon

Batch = dict[str, torch.Tensor]
Metrics = dict[str, torch.Tensor]

ZERO1_FORMS: dict[str, Callable[[MeshStepRunner, list[dict], OptimConfig], torch.optim.Optimizer]] = {
    # flat fp32 shards, gradients reduce-scattered onto them (its norm summed over pipeline stages)
    "adamw": lambda runner, groups, cfg: ZeRO1AdamW(groups, group=runner.replica_group, norm_group=runner.pp_group,
                                                    **OPTIMIZERS["adamw"].arguments(cfg, True)),
    # whole parameters per owner (Newton-Schulz needs whole matrices), gradients all-reduced
    "muon": lambda runner, groups, cfg: ZeRO1Muon(groups, group=runner.replica_group,
                                                  **OPTIMIZERS["muon"].arguments(cfg, True)),
}
"""``optim.name`` -> its ZeRO-1 form (``parallel.zero1``), built by the step runner over the dp group."""


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

    @property
    def routing_replay(self) -> bool:
        """Whether the rows' ``routed_experts`` (the sampler's routes) are replayed, not only compared
        (a pipeline's stages install them on their routers)."""

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

    def optimizers(self) -> Any:
        """Lightning's optimizer wrapper (``.optimizer`` is the optimizer the runner built)."""

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

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline-parallel ranks (None: no pipeline stages)."""
        return None

    def teardown(self) -> None:
        """Release what the runner set up for the step (hooks); nothing here."""

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
        or samples from a whole copy of it); see :meth:`MeshStepRunner.generation_group`."""
        return None

    def inference_view(self, model: nn.Module) -> nn.Module | PipelinedInference:
        """``model`` (the policy, or a frozen copy of it) as generation and frozen log-probs run it
        on this layout: itself, or chained through the pipeline stages it was cut to."""
        return model


class MeshStepRunner(LocalStepRunner):
    """The step on a (pp, edp, ep, cp, tp) device mesh without pipeline stages, built from the
    layout and the mesh: the vocab-parallel loss under tp, gradients reduced over dp (x cp) from
    backward hooks armed before the last backward (reduce-scattered onto the optimizer's shards
    under ZeRO-1), clipped by the global norm, and the optimizer itself. The Strategy keeps
    Lightning's lifecycle and the sharding of the model; this owns the step."""

    def __init__(self, layout: ParallelLayout, mesh: DeviceMesh | None, device: torch.device, rank: int = 0) -> None:
        super().__init__(None)
        self.layout = layout
        self.mesh = mesh
        self.device = device
        self.rank = rank
        """The global rank (the dp rank before a mesh exists)."""
        self._reducers: list[OverlappedGradientReducer] | None = None

    # -- coordinates and groups (the data module and callbacks ask these) --------------------------
    @property
    def shards_model(self) -> bool:  # type: ignore[override]
        """Whether a rank holds less than the whole model (tensor, pipeline or expert parallel)."""
        return self.layout.shards_model

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else self.rank

    @property
    def replicas(self) -> int:
        """Ranks whose gradients are averaged (dp x cp): they hold the same weights and other tokens."""
        return self.layout.replicas

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The (edp, ep, cp) ranks: the non-expert gradient reduction and every count a step
        normalises by (targets, expert loads) run over them."""
        return self.mesh["dp_cp"].get_group() if self.mesh is not None else None

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["cp"].get_group() if self.mesh is not None and self.layout.cp > 1 else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.mesh is not None and self.layout.pp > 1 else None

    def context_keys(self, seq_len: int, device: torch.device) -> ContextParallelKeys | None:
        """This rank's share of a forward over ``seq_len`` positions (None without context parallelism)."""
        group = self.cp_group
        return ContextParallelKeys(seq_len, group, device) if group is not None else None

    def generation_group(self, same_calls_on_every_replica: bool = True) -> dist.ProcessGroup | None:
        """The ranks that sample together from the sharded model itself, their forwards being
        collectives: the tp group, or under expert parallelism every rank (ep ranks are
        data-parallel ones, so every replica must generate as often as the others:
        ``same_calls_on_every_replica``), or with pipeline stages alone the pp group (a step's stages
        run one after the other, :mod:`dsl_lit.parallel.pipeline_inference`). None where sampling
        needs a whole copy: context- or sequence-parallel shards split one forward over positions."""
        layout = self.layout
        if not layout.shards_model or layout.cp > 1 or layout.sequence_parallel:
            return None
        if layout.ep > 1:
            return dist.group.WORLD if same_calls_on_every_replica else None
        return self.mesh["tp"].get_group() if layout.tp > 1 else self.pp_group

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The single-device state dict of the sharded ``model``, on every rank (collective)."""
        return full_state_dict(model, self.pp_group) if self.shards_model else model.state_dict()

    def reduce_over_replicas(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        """Reduce over the dp x cp ranks that see different tokens (tp ranks of a replica hold the
        same value); in place, as Lightning's ``Strategy.reduce`` does."""
        if self.layout.world_size == 1:
            return tensor
        group, average = self.replica_group, reduce_op.lower() in ("mean", "avg")
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if average else getattr(dist.ReduceOp, reduce_op.upper()),
                        group=group)
        if not average:
            return tensor
        size = dist.get_world_size(group)
        return tensor.div_(size) if tensor.is_floating_point() else tensor.copy_(tensor // size)

    # -- the step -------------------------------------------------------------------------------------
    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around a step's forwards and backwards: vocab-parallel cross-entropy under tp."""
        return loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext()

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        """The ``optim`` group's optimizer, or with ``parallel.zero1`` its dp-sharded form (same
        hyperparameters)."""
        if not (self.layout.zero1 and self.replicas > 1):
            return build_optimizer(model, cfg)
        return ZERO1_FORMS[cfg.name](self, optimizer_groups(model, cfg), cfg)

    def _gradient_reducers(self, model: nn.Module) -> list[OverlappedGradientReducer]:
        """Plain DP: one all-reduce over dp (x cp). With expert parallelism the routed experts (each
        rank's own) reduce over the ranks holding the same experts, divided by the full dp x cp
        size: their local gradient already sums the tokens of the whole ep group."""
        if self._reducers is None:
            experts = expert_parameters(model) if self.layout.ep > 1 else []
            expert_ids = {id(p) for p in experts}
            dense = [p for p in model.parameters() if p.requires_grad and id(p) not in expert_ids]
            self._reducers = [OverlappedGradientReducer(dense, self.replica_group)]
            if experts:  # (with ep = dp and cp = 1 that group is this rank alone: only the division remains)
                self._reducers.append(
                    OverlappedGradientReducer(experts, self.mesh["edp_cp"].get_group(), divisor=self.replicas)
                )
        return self._reducers

    def before_last_backward(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The module is about to run the step's last backward: arm the overlapped reduction
        (all-reduce buckets for plain DP, reduce-scatter buckets for ZeRO-1)."""
        if self.replicas == 1:
            return
        if isinstance(optimizer, ZeRO1AdamW):
            optimizer.arm()
            return
        for reducer in self._gradient_reducers(model):
            reducer.arm()

    @torch.no_grad()
    def finish_gradients(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """Complete the step's gradient reduction over dp and clip by the global norm (unscaling
        fp16 gradients in the same pass)."""
        if isinstance(optimizer, ZeRO1AdamW):
            return optimizer.reduce_gradients(max_norm, loss_scale)
        if self.replicas > 1:
            for reducer in self._gradient_reducers(model):
                if not reducer.armed:  # no overlap was armed (pipeline): wait() reduces every bucket now
                    reducer.arm()
                reducer.wait()
        return clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm, self.pp_group, loss_scale)

    def teardown(self) -> None:
        """Remove the gradient hooks (the end of fit)."""
        for reducer in self._reducers or []:
            reducer.remove_hooks()
        self._reducers = None


class PipelineStepRunner(MeshStepRunner):
    """The step through the strategy's pipeline schedule: each rank runs its stages' forwards and
    backwards over the step's micro-batches; the last stage computes the module's own objective
    on its micro-batch's rows. Metrics are summed over stages (the loss from the last stage,
    balance losses from where their MoE layers are), the same on every pipeline rank."""

    def __init__(self, layout: ParallelLayout, mesh: DeviceMesh | None, device: torch.device, rank: int = 0) -> None:
        super().__init__(layout, mesh, device, rank)
        self.pipeline: PipelineRunner | None = None
        """This rank's stages and schedule, once :meth:`cut` has cut the model."""
        self._metric_names: dict[str, list[str]] = {}
        self._module: StepModule | None = None
        self._batch: Batch | None = None
        self._normalizers: dict | None = None
        self._totals: Metrics = {}

    def run(self, module: StepModule, batch: Batch, normalizers: dict, backward: bool = True) -> Metrics:
        pipeline = self.stages()
        rows = batch["input_ids"].shape[0]
        pipeline.build_schedule(rows // module.micro_batch_size, self._last_stage_loss, tuple(batch["input_ids"].shape))
        self._module, self._normalizers, self._batch, self._totals = module, normalizers, batch, {}
        row_ids = torch.arange(rows, device=batch["input_ids"].device)  # the loss reads its rows' fields
        try:
            with self.loss_context():
                pipeline.step(batch["input_ids"], row_ids, float(rows), backward=backward,
                              loss_scale=module.loss_scale, inputs=module.model_inputs(batch),
                              replay_routes=module.routing_replay)
            totals: Metrics = dict(self._totals)
        finally:
            self._module = self._normalizers = self._batch = None
        balance = pipeline.balance_total()
        if balance is not None:
            totals["balance_loss"] = balance
        flipped = pipeline.route_flips()
        if flipped:  # this rank's routers; the mean over all of them once the stages summed theirs
            totals.update(flip_rates(flipped, normalizers["routed_tokens"]))
        totals.update(pipeline.index_totals())
        summed = mean_flip_rate(self._sum_over_stages(totals, "train" if backward else "val"))
        if "index_layers" in summed:  # the recalls' mean over every stage's indexers, as one process's
            layers, recalls = summed.pop("index_layers"), summed.pop("index_recall_sum")
            summed["index_recall"] = recalls / layers.clamp_min(1e-12) * (layers > 0)
        return summed

    def inference_view(self, model: nn.Module) -> nn.Module | PipelinedInference:
        pipeline = self.stages()
        if isinstance(model, PipelinedInference) or not pipeline.holds_stages_only(model):  # or a whole copy
            return model
        return PipelinedInference(model, pipeline.stage_layers, pipeline.owner, self.pp_group)

    def cut(self, model: nn.Module, model_config: Any, with_mtp: bool, copies: Sequence[nn.Module] = ()) -> None:
        """Cut ``model`` to this rank's pipeline stages under the layout's schedule (and ``copies``
        of it, such as a frozen reference, alike): the runner keeps the stages it then steps through."""
        self.pipeline = PipelineRunner(model, model_config, self.pp_group, self.layout.pp_schedule,
                                       self.layout.pp_virtual_stages, self.device, with_mtp=with_mtp,
                                       cp_group=self.cp_group)
        for copy in copies:
            self.pipeline.prune(copy)

    def stages(self) -> PipelineRunner:
        if self.pipeline is None:
            raise RuntimeError("no pipeline: the model is not cut into stages yet")
        return self.pipeline

    def _sum_over_stages(self, totals: Metrics, kind: str) -> Metrics:
        group = self.pp_group
        if kind not in self._metric_names:  # which metrics exist is agreed once per kind
            names: list[Any] = [None] * self.layout.pp
            dist.all_gather_object(names, sorted(totals), group=group)
            self._metric_names[kind] = sorted(set().union(*names))
        zero = torch.zeros((), device=self.device)
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
