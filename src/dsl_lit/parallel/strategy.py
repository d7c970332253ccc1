"""The Lightning Strategy that runs our LightningModules on a device mesh.

It runs a (pp, edp, ep, cp, tp) device mesh (dp = edp x ep) over ``trainer.devices x
trainer.num_nodes`` processes (gloo on CPU, NCCL on GPU); tp ranks are adjacent (one node), then
cp, then ep, then the rest of dp, with pipeline stages outermost. What it applies, from outside the model:

- data parallelism, plain or with ZeRO-1 (:mod:`dsl_lit.parallel.zero1`);
- tensor (+ sequence) parallelism with each family's plan (:mod:`dsl_lit.parallel.tensor_parallel`);
- pipeline parallelism with a ``torch.distributed.pipelining`` schedule (:mod:`dsl_lit.parallel.pipeline`);
- expert parallelism with all-to-all dispatch (:mod:`dsl_lit.parallel.expert_parallel`);
- context parallelism: each cp rank runs its load-balanced share of every sequence's positions
  (:mod:`dsl_lit.parallel.context_parallel`); cp ranks average gradients like dp replicas.

The LightningModule never names this class: it runs its step through :attr:`step_runner`
(:mod:`dsl_lit.parallel.step_runner`), a plain micro-batch loop or the pipeline schedule.

Why not Lightning's DDPStrategy as is: DDP all-reduces on every backward, but our modules run
several micro-batches per optimizer step inside ``training_step`` (so that a pipeline schedule or
ZeRO-1 can own the step). Here gradients accumulate locally over the micro-batches and are
reduced once per step, bucket by bucket from backward hooks during the last micro-batch's backward:
all-reduced for plain DP (:mod:`dsl_lit.parallel.grad_sync`; routed experts over the ranks that
hold the same experts), reduce-scattered onto the optimizer shards for ZeRO-1;
:meth:`DeepSeekStrategy.finish_gradients` completes it and clips by the global norm (summed over
pipeline stages). The model is not wrapped, so module names stay the single-device ones and
checkpoints (every rank's shards, by those names; :mod:`dsl_lit.parallel.checkpointing`) load
under any other layout.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from dsl_lit.config.optim import OptimConfig
from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.optim import build_optimizer, param_groups
from dsl_lit.optim.adamw import adamw_arguments
from dsl_lit.optim.clip import clip_grad_norm_
from dsl_lit.parallel.checkpointing import ShardedCheckpointing
from dsl_lit.parallel.context_parallel import ContextParallelKeys, apply_context_parallel
from dsl_lit.parallel.expert_parallel import apply_expert_parallel, expert_parameters
from dsl_lit.parallel.full_state import full_state_dict
from dsl_lit.parallel.grad_sync import OverlappedGradientReducer
from dsl_lit.parallel.materialise import has_meta_tensors
from dsl_lit.parallel.mesh import build_device_mesh
from dsl_lit.parallel.pipeline import PipelineRunner
from dsl_lit.parallel.step_runner import MeshStepRunner, PipelineStepRunner
from dsl_lit.parallel.tensor_parallel import apply_tensor_parallel, place_gradients_like_parameters
from dsl_lit.parallel.zero1 import ZeRO1AdamW
from dsl_lit.precision.auto import check_ranks_agree


class DeepSeekStrategy(ShardedCheckpointing, DDPStrategy):
    strategy_name = "dsl_lit"

    def __init__(self, layout: ParallelLayout, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layout = layout
        self.mesh: DeviceMesh | None = None
        self._reducers: list[OverlappedGradientReducer] | None = None
        self._pipeline: PipelineRunner | None = None
        self._runner: MeshStepRunner | None = None

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.world_size != self.layout.world_size:
            raise RuntimeError(f"the layout was validated for {self.layout.world_size} processes, "
                               f"Lightning started {self.world_size}")
        self.mesh = build_device_mesh(self.layout, self.root_device.type)
        check_ranks_agree()

    # -- data-parallel coordinates (the data module shards batches by these) ------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else self.global_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp

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

    def context_keys(self, seq_len: int, device: torch.device) -> ContextParallelKeys | None:
        """This rank's share of a forward over ``seq_len`` positions (None without context parallelism)."""
        group = self.cp_group
        return ContextParallelKeys(seq_len, group, device) if group is not None else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.mesh is not None and self.layout.pp > 1 else None

    @property
    def shards_model(self) -> bool:
        """Whether a rank holds less than the whole model (tensor, pipeline or expert parallel)."""
        return self.layout.shards_model

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
        return full_state_dict(model, self.pp_group)

    def reduce_over_replicas(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        """Reduce across the dp x cp ranks that see different tokens (tp ranks of a replica hold
        the same value)."""
        if self.world_size == 1:
            return tensor
        return self.reduce(tensor, group=self.replica_group, reduce_op=reduce_op)

    # -- no DDP wrapper; tensor parallelism applied here -------------------------------------------
    def model_to_device(self) -> None:
        """A model still on the meta device (starting weights not read yet) is allocated on this
        rank's device by :meth:`configure_ddp`, once it holds only this rank's part."""
        if not has_meta_tensors(self.model):
            super().model_to_device()

    def configure_ddp(self) -> None:
        """Keep the module unwrapped; prune the model to this rank's pipeline stages, shard it over
        the tp and ep mesh dimensions. A randomly initialised model starts from rank 0's weights
        and buffers (broadcast first). A model the module left on the meta device (starting weights
        from files) is cut down first and then allocated, each rank reading only its own tensors
        (``module.load_initial_weights``): no rank ever holds the whole model."""
        module = self.lightning_module
        deferred = has_meta_tensors(module.model)
        if not deferred and dist.is_available() and dist.is_initialized():
            with torch.no_grad():
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(tensor, src=0)
        if self.layout.pp > 1:  # drop what this rank's stages do not hold, before sharding the rest
            self._pipeline = PipelineRunner(
                module.model, module.model_config, self.pp_group, self.layout.pp_schedule,
                self.layout.pp_virtual_stages, self.root_device, with_mtp=module.trains_mtp, cp_group=self.cp_group,
            )
        if self.layout.tp > 1:
            apply_tensor_parallel(module.model, module.model_config, self.mesh["tp"], self.layout.sequence_parallel,
                                  hook_gradients=not deferred)
        if self.layout.ep > 1:
            apply_expert_parallel(module.model, self.mesh["ep"])
        if self.generation_group() is not None:  # a KL reference: sharded like the policy, run on its shards
            for frozen in module.frozen_copies():
                if self._pipeline is not None:
                    self._pipeline.prune(frozen)
                if self.layout.tp > 1:
                    apply_tensor_parallel(frozen, module.model_config, self.mesh["tp"], hook_gradients=False)
                if self.layout.ep > 1:
                    apply_expert_parallel(frozen, self.mesh["ep"])
        if self.layout.cp > 1:
            apply_context_parallel(module.model, self.cp_group)
        if deferred:
            module.load_initial_weights(self.root_device)
            if self.layout.tp > 1:
                place_gradients_like_parameters(module.model)

    # -- how the module's step runs on this layout ------------------------------------------------
    @property
    def step_runner(self) -> MeshStepRunner:
        """What the LightningModule runs its step through (:mod:`dsl_lit.parallel.step_runner`)."""
        if self._runner is None:
            self._runner = PipelineStepRunner(self) if self.layout.pp > 1 else MeshStepRunner(self)
        return self._runner

    @property
    def pipeline(self) -> PipelineRunner:
        """This rank's pipeline stages and schedule (``parallel.pp > 1``; built in :meth:`configure_ddp`)."""
        if self._pipeline is None:
            raise RuntimeError("no pipeline: parallel.pp=1, or the model is not set up yet")
        return self._pipeline

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        """AdamW, or with ``parallel.zero1`` its dp-sharded form (same hyperparameters)."""
        if not (self.layout.zero1 and self.replicas > 1):
            return build_optimizer(model, cfg)
        return ZeRO1AdamW(
            param_groups(model, cfg.weight_decay), group=self.replica_group, norm_group=self.pp_group,
            **adamw_arguments(cfg),
        )

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around a step's forwards and backwards: vocab-parallel cross-entropy under tp."""
        return loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext()

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
        for reducer in self._reducers or []:
            reducer.remove_hooks()
        self._reducers = None
        super().teardown()
