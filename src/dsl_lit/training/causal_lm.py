"""The base LightningModule every objective (pretrain, SFT, DPO, GRPO) derives from.

Why manual optimization: one ``training_step`` is one optimizer step over this rank's share of the
global batch. The module splits it into micro-batches and runs forward+backward for each, so the
same module can later hand the whole step to a pipeline schedule (which owns its own backward) or
to a ZeRO-1 optimizer, with no private Lightning loop internals. Subclasses only say what the loss
of a micro-batch is and which step-wide counts normalise it.

After each optimizer step the module also runs DeepSeek-V3's auxiliary-loss-free balancing: the
expert loads counted over all micro-batches of the step (summed over data-parallel ranks) move
each router's expert bias.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import lightning as L
import torch
from torch import nn

from dsl_lit.config.data import BatchSchedule
from dsl_lit.config.memory import MemoryConfig
from dsl_lit.config.objective import ObjectiveConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.moe import Router, TopKRouter
from dsl_lit.optim import build_lr_scheduler
from dsl_lit.parallel.model_setup import ModelSetup
from dsl_lit.parallel.model_transforms import TransformPlan, is_fitting
from dsl_lit.parallel.step_runner import LocalStepRunner, step_runner_of
from dsl_lit.precision.loss_scaler import DynamicLossScaler
from dsl_lit.precision.plugin import AutocastPrecision
from dsl_lit.training.pretrained import StartingWeights
from dsl_lit.training.step_checks import PendingStepChecks
from dsl_lit.utils.materialise import local_target

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
Metrics = dict[str, torch.Tensor]


class CausalLMModule(L.LightningModule):
    def __init__(
        self,
        model_config: ModelConfig,
        optim: OptimConfig,
        schedule: ScheduleConfig,
        micro_batch_size: int,
        total_steps: int,
        objective: ObjectiveConfig | None = None,
        precision: PrecisionConfig | None = None,
        memory: MemoryConfig | None = None,
        max_bad_steps: int = 10,
        initial_state: dict[str, torch.Tensor] | StartingWeights | None = None,
        batch_schedule: BatchSchedule | None = None,
        transform_plan: TransformPlan | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self._step_logs: dict[str, tuple[Any, dict[str, Any]]] = {}
        self.model_config = model_config
        self.optim_config = optim
        self.schedule_config = schedule
        self.micro_batch_size = micro_batch_size
        self.total_steps = total_steps
        self.objective = (objective or ObjectiveConfig()).validate()
        self.precision = (precision or PrecisionConfig()).validate()
        self.memory = (memory or MemoryConfig()).validate()
        self.max_bad_steps = max_bad_steps
        self.initial_state = initial_state
        """Starting weights (``init_from``): a state dict, or weights read where the model is set up
        (:class:`StartingWeights`); None: the model's random init. A resumed run's checkpoint
        overwrites them."""
        self.transform_plan = transform_plan or TransformPlan.of(self.precision, self.memory)
        """What the strategy applies to the built model besides its layout, in the one order of
        :mod:`dsl_lit.parallel.model_transforms` (FP8, recompute, compile): the run's plan
        (``dsl_lit.training.run_plan``), or, for a module made by hand, its precision and memory
        settings'."""
        self.batch_schedule = batch_schedule
        """The run's global batch per step (a batch ramp): schedules counted in tokens follow it."""
        self.bad_steps_in_a_row = 0
        self.steps_applied = 0
        """Optimizer steps this run applied (not skipped), since it started or resumed."""
        self.loss_scaler = DynamicLossScaler(
            enabled=self.precision.name == "fp16",
            init_scale=self.precision.loss_scale_init,
            growth_interval=self.precision.loss_scale_growth_interval,
        )
        self.model: nn.Module | None = None
        self.tokens_seen = 0
        self.pending_checks = PendingStepChecks()
        """Steps whose gradient check is still on the device (see :attr:`step_checks_on_device`)."""
        self.last_expert_load: torch.Tensor | None = None
        """[moe layers, experts] tokens routed in the last step (all ranks), for monitoring."""

    # -- model construction -------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the model here, not in ``__init__``, so that starting weights read from files
        (:class:`StartingWeights`) need no full copy anywhere: the model is built on the meta device
        and, when the layout splits it, left there for the strategy to prune and shard before each
        rank reads its own part (:meth:`load_initial_weights`). A random init is built as always (the
        same RNG draws in every layout). Idempotent, as Lightning requires."""
        if self.model is not None:
            return
        lazy = isinstance(self.initial_state, StartingWeights)
        with torch.device("meta") if lazy else contextlib.nullcontext():
            self.model = build_model(self.model_config)
        if not self.trains_mtp:
            # kept as they are (post-training): frozen, so the optimizer holds no state for them that
            # a checkpoint would lack (AdamW makes state on a parameter's first gradient only)
            self.model.mtp.requires_grad_(False)
        if self.model_config.index_training == "warmup":  # DeepSeek-V3.2's dense warm-up: only the indexers learn
            for name, parameter in self.model.named_parameters():
                parameter.requires_grad_(".indexer." in name)
        trainer = self._trainer  # None: built by hand, transformed by whichever strategy runs it later
        wanted = self.transform_plan.wanted(is_fitting(trainer), speed_only=False) if trainer is not None else []
        if wanted and not isinstance(trainer.strategy, ModelSetup):
            raise RuntimeError(f"{', '.join(wanted)} of this module are applied by dsl_lit's strategy: build the "
                              "Trainer with dsl_lit.training.build.build_trainer(cfg), or pass "
                              "the strategy of dsl_lit.parallel.strategy (no arguments for one process)")
        if not lazy:
            if self.initial_state is not None:
                self.model.load_state_dict(self.initial_state, strict=True)
                self.initial_state = None
            self.on_initial_weights()
        elif self.whole_model_at_start or not self.runner.shards_model:
            self.load_initial_weights(torch.get_default_device())  # where the strategy builds models

    def load_initial_weights(self, device: torch.device) -> None:
        """Read the starting weights into the model left on the meta device, on ``device``: the
        whole model, or (called by the strategy once it has pruned and sharded it) only the
        tensors, shards and experts this rank holds."""
        self.initial_state.load(self.model, device)
        self.initial_state = None
        self.on_initial_weights()

    @property
    def whole_model_at_start(self) -> bool:
        """Whether :meth:`on_initial_weights` needs the whole model (a frozen reference copy of it):
        starting weights are then read whole on every rank, before the layout splits the model."""
        return False

    def on_initial_weights(self) -> None:
        """Hook: the model holds its starting weights (DPO caches reference log-probs here)."""

    def frozen_copies(self) -> list[nn.Module]:
        """Frozen models shaped like the policy (a KL reference) that the strategy cuts and shards
        with it on layouts whose shards can score tokens without a whole copy (tensor and expert
        parallelism, pipeline stages chained through the pp ranks)."""
        return []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    @property
    def progress(self) -> float:
        """Fraction of training done before the current step (drives coefficient schedules)."""
        step = self.trainer.global_step
        if self.batch_schedule is not None and self.batch_schedule.ramp.enabled:  # fractions of tokens
            return self.batch_schedule.advance(0, step) / self.batch_schedule.advance(0, max(1, self.total_steps))
        return step / max(1, self.total_steps)

    @property
    def runner(self) -> LocalStepRunner:
        """How this step runs on the layout: the strategy's step runner (no trainer: one device)."""
        return step_runner_of(self._trainer.strategy if self._trainer is not None else None)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale the objective is multiplied by before backward (1.0 otherwise)."""
        return self.loss_scaler.scale if self.loss_scaler.enabled else 1.0

    @property
    def mtp_depth(self) -> int:
        """MTP modules of the model (from the config: a pipeline stage may not hold them)."""
        return self.model_config.mtp_modules

    # -- what a subclass defines -------------------------------------------------------------------
    def loss_normalizers(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Step-wide counts the micro-batch losses are divided by: the step's targets (over all
        data-parallel replicas, see :meth:`replica_share`) and this rank's sequences (every
        replica has as many; the MoE balance loss is a mean over sequences)."""
        labels = batch["labels"]
        return {
            "targets": self.replica_share((self.targets(labels) != -100).sum()),
            "sequences": torch.full((), float(labels.shape[0]), device=labels.device),  # a fill, not a host copy
        }

    def targets(self, labels: torch.Tensor, k: int = 0) -> torch.Tensor:
        """The labels this rank's outputs predict: the main head's (``k = 0``) or MTP depth k's
        (``labels[:, k:]``); under context parallelism at this rank's positions of the rows."""
        shard = self.runner.context_keys(labels.shape[1], labels.device)
        if shard is None:
            return labels[:, k:]
        return shard.shift(labels, k, fill=-100) if k else shard.shard(labels)

    def replica_share(self, count: torch.Tensor) -> torch.Tensor:
        """``count`` summed over the replicas (data-parallel x context-parallel ranks), divided by
        their number (at least 1).

        Why: gradients are averaged over replicas, so a replica that divides its loss sum by this
        contributes ``sum / global count``, and the step's loss is the mean over every target of
        the global batch, however unevenly padding or prompt masks spread targets over replicas
        (SFT rows, completions, a sequence's positions over cp ranks). With one replica it is the
        count itself."""
        count = count.float()
        runner = self.runner
        if runner.replicas > 1:
            return runner.reduce_over_replicas(count.clone(), "sum").clamp_min(1) / runner.replicas
        return count.clamp_min(1)

    def loss_from_outputs(
        self, outputs: tuple[torch.Tensor, ...], micro_batch: Batch, normalizers: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        """(objective to backpropagate, detached metrics) of one micro-batch from the model's
        outputs (logits, then MTP logits when :attr:`trains_mtp`) and the micro-batch's fields
        (``labels``, and whatever else the objective's rows carry), each already divided by the
        step-wide ``normalizers`` so that summing over micro-batches gives the step's value. A
        pipeline's last stage calls this too, so it must not run the policy model."""
        raise NotImplementedError

    def step_metrics(self) -> dict[str, float]:
        """Extra per-step values to log (e.g. a coefficient schedule)."""
        return {}

    @property
    def trains_mtp(self) -> bool:
        """Whether the objective uses the MTP modules' logits (pretraining does)."""
        return True

    @property
    def routing_replay(self) -> bool:
        """Whether rows carrying a sampler's routes (RL) have them replayed: not outside RL."""
        return False

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-row model inputs besides the token ids (``positions``, ``key_valid``), rows first:
        what every pipeline stage receives with its micro-batch. Plain causal rows need none."""
        return {}

    def model_outputs(self, input_ids: torch.Tensor, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(logits, logits of each MTP depth): what a pipeline's last stage also returns. Under
        context parallelism, at this rank's positions of the rows (see :meth:`targets`)."""
        shard = self.runner.context_keys(input_ids.shape[1], input_ids.device)
        if shard is None:
            residual = self.model.residual(input_ids, inputs.get("positions"), inputs.get("key_valid"))
        else:  # plain causal rows only (TrainConfig refuses parallel.cp for post-training's rows)
            positions = shard.query_positions.expand(input_ids.shape[0], -1)
            residual = self.model.residual(shard.shard(input_ids), positions, cache=shard)
        logits = self.model.head(self.model.collapse(residual))
        if not (self.trains_mtp and len(self.model.mtp)):
            return (logits,)
        return (logits, *self.model.mtp_logits(residual, input_ids, shard))

    def micro_batch_objective(self, micro_batch: Batch, normalizers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        """Run the model on one micro-batch and return ``loss_from_outputs`` (the same path a
        pipeline schedule takes, stage by stage)."""
        outputs = self.model_outputs(micro_batch["input_ids"], **self.model_inputs(micro_batch))
        return self.loss_from_outputs(outputs, micro_batch, normalizers)

    def micro_batch_loss(self, micro_batch: Batch, normalizers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        """Run the model on one micro-batch; its objective plus the MoE balance loss (the share of
        the step's sequences it covers)."""
        objective, metrics = self.micro_batch_objective(micro_batch, normalizers)
        share = micro_batch["labels"].shape[0] / normalizers["sequences"]  # of the step's sequences
        balance = self.model.balance_loss()
        if balance is not None:
            balance = balance * share
            objective = objective + balance
            metrics["balance_loss"] = balance.detach()
        index = self.model.index_losses()
        if index is not None:  # DeepSeek-V3.2's indexer KL: its inputs are detached, it trains the indexer only
            kl, recall = index
            objective = objective + kl * share
            metrics["index_kl"], metrics["index_recall"] = kl.detach() * share, recall * share
        return objective, metrics

    def tokens_in_batch(self, batch: Batch) -> int:
        """Tokens processed by this rank in one step (for throughput; includes padding)."""
        return batch["input_ids"].numel()

    # -- one optimizer step --------------------------------------------------------------------------
    def forward_backward(self, batch: Batch) -> Metrics:
        """Forward and backward over micro-batches; gradients accumulate in the (fp32) parameters.

        Returns this rank's step metrics (``loss``: mean loss per target). Each micro-batch loss is
        divided by counts of the whole step, so the accumulated gradient equals the gradient of
        the step's mean however the batch is split. Under pipeline parallelism the strategy's
        schedule runs the micro-batches instead (same losses, same normalisation).
        """
        return self.runner.run(self, batch, self.loss_normalizers(batch))

    step_checks_on_device: bool | None = None
    """Whether a step's gradient check is read on the host in batches (:mod:`~dsl_lit.training.step_checks`)
    rather than every step; None: where it saves a host sync (CUDA, no fp16 loss scaling, torch's
    fused AdamW, which skips a step on the device)."""

    def _checks_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.step_checks_on_device is not None:
            return self.step_checks_on_device
        fused = isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))
        return fused and not self.loss_scaler.enabled and self.device.type == "cuda"

    defer_step_logs: bool = False
    """Set by :class:`~dsl_lit.training.callbacks.run_log.RunLog` at the start of fit: the step's
    scalars are kept (:meth:`log_step`) and handed to ``self.log`` by it only on the steps Lightning
    writes to the loggers. Each ``self.log`` costs ~1.5 ms on CPU whatever the value (Lightning
    walks its per-key state to move it to the value's device), and a step logs ~13 of them: 40% of a
    tiny model's 45 ms step in the scaling sweep (cProfile, 2-core Xeon), for values Lightning then
    drops on every step but each ``trainer.log_every_n_steps``-th. A Trainer without RunLog logs
    every step as Lightning expects."""

    def log_step(self, name: str, value: Any, **log_kwargs: Any) -> None:
        """``self.log(name, value, **log_kwargs)`` for this step: now, or kept (:attr:`defer_step_logs`)."""
        if self.defer_step_logs:
            self._step_logs[name] = (value, log_kwargs)
        else:
            self.log(name, value, **log_kwargs)

    def flush_step_logs(self, written: bool) -> None:
        """Hand the kept values to ``self.log`` if Lightning writes this step (the same answer on every
        rank: ``sync_dist`` values reduce here), else drop them."""
        logs, self._step_logs = self._step_logs, {}
        if written:
            for name, (value, log_kwargs) in logs.items():
                self.log(name, value, **log_kwargs)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        metrics, grad_norm, lr, scale, extra = self.optimizer_step_on(batch)
        self.log_step("train/global_batch_size", float(batch["input_ids"].shape[0] * self.runner.dp_size))
        sync = self.trainer.world_size > 1
        self.log_step("train/loss", metrics["loss"], prog_bar=True, sync_dist=sync)
        for name, value in metrics.items():
            if name != "loss":
                self.log_step(f"train/{name}", value, sync_dist=sync)
        self.log_step("train/lr", lr)
        self.log_step("train/grad_norm", grad_norm.float())
        self.log_step("train/skipped_steps", float(self.loss_scaler.skipped_steps))
        if self.loss_scaler.enabled:
            self.log_step("train/loss_scale", scale)
        for name, value in extra.items():
            self.log_step(f"train/{name}", value)
        return metrics["loss"]

    def optimizer_step_on(self, batch: Batch) -> tuple[Metrics, torch.Tensor, float, float, dict[str, Any]]:
        """One optimizer step on ``batch`` (forwards, backwards, gradient reduction and clipping, the
        update, the schedule, the expert biases), no logging: (metrics, gradient norm, the step's
        learning rate, loss scale, step metrics). With the checks on the device it makes no host sync."""
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        metrics = self.forward_backward(batch)
        extra = self.step_metrics()  # before the step: global_step moves with optimizer.step()
        scale = self.loss_scaler.scale
        grad_norm = self.finish_gradients(optimizer.optimizer, self.optim_config.grad_clip or None, scale)
        lr = optimizer.param_groups[0]["lr"]
        progress = self.progress
        step = self.trainer.global_step
        if self._checks_on_device(optimizer.optimizer):
            finite = torch.isfinite(grad_norm)
            optimizer.optimizer.found_inf = (~finite).float()  # the fused kernel skips the update itself
            self.pending_checks.add(step, finite, metrics["loss"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            self.update_expert_bias(self.objective.bias_update_rate_at(progress) * finite)
            every = max(1, int(getattr(self.trainer, "log_every_n_steps", 1) or 1))
            if (step + 1) % every == 0 or self._last_step(step):
                self.read_step_checks()
        else:
            skip = self.loss_scaler.update(float(grad_norm))  # non-finite gradients: no update this step
            self._guard_bad_steps(skip, metrics, step)
            plugin = self.trainer.precision_plugin
            if skip and isinstance(plugin, AutocastPrecision):
                plugin.skip_next_step = True  # still counted by Lightning: schedule and data stay in step
            if not skip or isinstance(plugin, AutocastPrecision):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            self.update_expert_bias(0.0 if skip else self.objective.bias_update_rate_at(progress))
        self.tokens_seen += self.tokens_in_batch(batch) * self.runner.dp_size
        return metrics, grad_norm, lr, scale, extra

    def _last_step(self, step: int) -> bool:
        return self.trainer.max_steps > 0 and step + 1 >= self.trainer.max_steps

    def read_step_checks(self) -> None:
        """Read the queued steps' checks (one host sync) and apply what :meth:`_guard_bad_steps`
        applies to each, in order: counts, warnings, the stop after too many bad steps."""
        for outcome in self.pending_checks.drain():
            skip = self.loss_scaler.update(0.0 if outcome.finite else math.inf)
            what = None if outcome.finite else (
                f"the loss is {outcome.loss}" if not math.isfinite(outcome.loss)
                else f"the gradient norm is non-finite (loss {outcome.loss}; the update was skipped on the device)")
            self._guard_bad_steps(skip, {}, outcome.step, what)

    def _guard_bad_steps(self, skipped: bool, metrics: Metrics, step: int, what: str | None = None) -> None:
        """NaN/inf guard: a step with non-finite gradients is skipped (logged, naming what was
        non-finite, and counted); after ``max_bad_steps`` of them in a row the run stops, before any
        update or save from the bad steps, so the last checkpoint on disk is a good one. A run whose
        every step was skipped stops at its last step too: it never ends "complete" with a
        checkpoint of weights it never trained."""
        self.bad_steps_in_a_row = self.bad_steps_in_a_row + 1 if skipped else 0
        self.steps_applied += 0 if skipped else 1
        if not skipped:
            return
        scaled = self.loss_scaler.enabled  # fp16's loss scaler skips overflowing steps by design
        stop = bool(self.max_bad_steps) and self.bad_steps_in_a_row >= self.max_bad_steps
        last = self._last_step(step)
        all_skipped = last and self.steps_applied == 0 and not scaled
        if scaled and not stop:
            return  # (the report costs a pass over every gradient: only when it is said)
        what = what or self.non_finite_report(metrics)
        if not scaled:
            log.warning("step %d skipped: %s", step, what)
        if stop:
            raise FloatingPointError(
                f"{self.bad_steps_in_a_row} optimizer steps in a row were skipped (step {step}: {what}); "
                "stopping with the last good checkpoint intact"
            )
        if all_skipped:
            raise FloatingPointError(
                f"every step of this run was skipped (last, step {step}: {what}); no checkpoint of it is written"
            )

    def non_finite_report(self, metrics: Metrics) -> str:
        """What was non-finite in the step just run: the loss, or the gradients of which parameters
        (this rank's; the first five named)."""
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        bad = [name for name, p in self.model.named_parameters()
               if p.grad is not None and not bool(torch.isfinite(local_target(p.grad)[0]).all())]
        if not bad:
            return f"the gradient norm over all ranks is non-finite (loss {loss}; this rank's gradients are finite)"
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        return f"non-finite gradients of {', '.join(bad[:5])}{more} (loss {loss})"

    @torch.no_grad()
    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        """Held-out loss (``val/loss``, the main next-token loss per target), for any layout: under
        pipeline parallelism the schedule's forward-only pass computes it on the last stage."""
        metrics = self.runner.run(self, batch, self.loss_normalizers(batch), backward=False)
        sync = self.trainer.world_size > 1
        for name, value in metrics.items():
            self.log(f"val/{name}", value, sync_dist=sync, prog_bar=name == "loss")
        return metrics["loss"]

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """Auxiliary-loss-free balancing after the optimizer step: every router's bias moves by
        ``rate * sign(mean load - load)`` using the loads of all micro-batches and all ranks."""
        for fixed in (m for m in self.model.modules() if isinstance(m, Router) and not isinstance(m, TopKRouter)):
            fixed.load.reset_parameters()  # DeepSeek-V4's hash routes: counted, nothing to balance
        routers = [m for m in self.model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            return
        loads = self.runner.reduce_over_replicas(torch.stack([router.load.counts for router in routers]), "sum")
        for router, load in zip(routers, loads):
            router.update_bias(load, rate)
            router.load.reset_parameters()
        self.last_expert_load = loads

    def finish_gradients(
        self, optimizer: torch.optim.Optimizer, max_norm: float | None, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """Gradients of the whole step are ready: reduce them across data-parallel ranks (the
        strategy's job when it has one) and clip by the global norm; returns the norm."""
        return self.runner.finish_gradients(self.model, optimizer, max_norm, loss_scale)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.runner.build_optimizer(self.model, self.optim_config)
        scheduler = build_lr_scheduler(optimizer, self.schedule_config, self.total_steps, self.batch_schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- exact resume of counters that live outside the optimizer ------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.read_step_checks()  # a run that must stop on bad steps stops before it saves them
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["loss_scaler"] = self.loss_scaler.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        if "loss_scaler" in checkpoint:
            self.loss_scaler.load_state_dict(checkpoint["loss_scaler"])
