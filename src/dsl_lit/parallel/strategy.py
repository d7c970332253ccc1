"""The Lightning Strategy that runs our LightningModules, on one process or on a device mesh.

Every run has it, whatever its world size. On several processes it runs a (pp, edp, ep, cp, tp)
device mesh (dp = edp x ep) over ``trainer.devices x trainer.num_nodes`` processes (gloo on CPU,
NCCL on GPU); tp ranks are adjacent (one node), then cp, then ep, then the rest of dp, with
pipeline stages outermost. On one process the mesh is the trivial one: no process group is
started, nothing is launched, and the step runs through the same runner with every dimension 1
(what Lightning's single-device strategy did, without a second class to keep in step). What it
applies, from outside the model:

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
the step runner's ``finish_gradients`` (:class:`~dsl_lit.parallel.step_runner.MeshStepRunner`) completes it and clips by the global norm (summed over
pipeline stages). The model is not wrapped, so module names stay the single-device ones and
checkpoints (every rank's shards, by those names; :mod:`dsl_lit.parallel.checkpointing`) load
under any other layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.distributed.device_mesh import DeviceMesh

from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.parallel.checkpointing import ShardedCheckpointing
from dsl_lit.parallel.layout_steps import layout_steps
from dsl_lit.parallel.mesh import build_device_mesh
from dsl_lit.parallel.model_setup import ModelSetup
from dsl_lit.parallel.model_transforms import is_fitting
from dsl_lit.parallel.step_runner import MeshStepRunner, PipelineStepRunner
from dsl_lit.parallel.tensor_parallel import place_gradients_like_parameters
from dsl_lit.precision.auto import check_ranks_agree
from dsl_lit.utils.materialise import has_meta_tensors

ONE_PROCESS = ParallelLayout(world_size=1, dp=1)
"""The layout of a one-process run: every mesh dimension 1."""


class DeepSeekStrategy(ModelSetup, ShardedCheckpointing, DDPStrategy):
    """Every run's strategy: one process, or several on a (pp, dp, ep, cp, tp) device mesh. No DDP
    wrapper (the step runner reduces gradients); the model transformed in :class:`ModelSetup`'s
    hook, with this layout's steps when fitting, alone otherwise (Lightning shards nothing then).
    The Trainer's ``accelerator`` and ``devices`` place every rank, the one of a one-process run
    included."""

    strategy_name = "dsl_lit"

    def __init__(self, layout: ParallelLayout = ONE_PROCESS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layout = layout
        self.mesh: DeviceMesh | None = None
        self._runner: MeshStepRunner | None = None

    @property
    def one_process(self) -> bool:
        """Whether the layout is one process: no process group, no launcher, no mesh."""
        return self.layout.world_size == 1

    def _configure_launcher(self) -> None:
        if self.one_process:
            self._launcher = None  # nothing to start (Lightning's launcher would set rank variables here)
            return
        super()._configure_launcher()

    def setup_environment(self) -> None:
        if self.one_process:
            self.set_world_ranks()  # rank 0 of 1 (Lightning's rank_zero_only included)
            super(DDPStrategy, self).setup_environment()  # the device alone: no process group
        else:
            super().setup_environment()
        if self.world_size != self.layout.world_size:
            raise RuntimeError(f"the layout was validated for {self.layout.world_size} processes, "
                               f"Lightning started {self.world_size}")
        self.mesh = None if self.one_process else build_device_mesh(self.layout, self.root_device.type)
        self._runner = None  # built again on the mesh
        check_ranks_agree()

    def setup(self, trainer: Any) -> None:
        if self.one_process:  # no module states to synchronise, no replicas to broadcast to
            Strategy.setup(self, trainer)
            return
        if not is_fitting(trainer):  # DDPStrategy sets the model up (configure_ddp) only when fitting
            self.model = self._setup_model(self.model)
        super().setup(trainer)

    # -- no DDP wrapper; the layout applied here -------------------------------------------------
    def model_to_device(self) -> None:
        """A model still on the meta device (starting weights not read yet) is allocated on this
        rank's device by :meth:`configure_ddp`, once it holds only this rank's part."""
        if not has_meta_tensors(self.model):
            super().model_to_device()

    def configure_ddp(self) -> None:
        """Keep the module unwrapped and set its model up (:class:`ModelSetup`: FP8 and recompute as
        the module asks, then this layout's steps, then compile). A randomly initialised model
        starts from rank 0's weights and buffers (broadcast first). A model the module left on the
        meta device (starting weights from files) is cut down first and then allocated, each rank
        reading only its own tensors (``module.load_initial_weights``): no rank ever holds the
        whole model."""
        module = self.lightning_module
        deferred = has_meta_tensors(module.model)
        if not deferred and dist.is_available() and dist.is_initialized():
            with torch.no_grad():
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(tensor, src=0)
        self.model = self._setup_model(self.model)
        if deferred:
            module.load_initial_weights(self.root_device)
            if self.layout.tp > 1:
                place_gradients_like_parameters(module.model)

    def layout_steps(self, module: Any) -> dict[str, Callable[[], None]]:
        """Prune to this rank's pipeline stages, then shard over the tp, ep and cp mesh dimensions
        (:mod:`dsl_lit.parallel.layout_steps`); a frozen copy that samples on the shards (a KL
        reference) alike."""
        if self.one_process:
            return {}  # nothing to cut or shard
        plan = module.transform_plan
        if plan.fp8 is not None and plan.fp8_experts and self.layout.ep > 1:
            raise ValueError("the module's transform plan converts the routed experts to FP8 under expert "
                             "parallelism; build the module with dsl_lit.training.build.module_arguments(cfg)")
        runner = self.step_runner
        frozen = module.frozen_copies() if runner.generation_group() is not None else []
        return layout_steps(self.layout, self.mesh, runner, module.model, module.model_config,
                            with_mtp=module.trains_mtp, copies=frozen,
                            hook_gradients=not has_meta_tensors(module.model))

    # -- how the module's step runs on this layout ------------------------------------------------
    @property
    def step_runner(self) -> MeshStepRunner:
        """What the LightningModule (and the data module, callbacks) run the step through and ask for
        data-parallel coordinates and groups (:mod:`dsl_lit.parallel.step_runner`)."""
        if self._runner is None:
            kind = PipelineStepRunner if self.layout.pp > 1 else MeshStepRunner
            self._runner = kind(self.layout, self.mesh, self.root_device, self.global_rank)
        return self._runner

    def teardown(self) -> None:
        if self._runner is not None:
            self._runner.teardown()
        super().teardown()
