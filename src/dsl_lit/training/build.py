"""Turning a validated ``TrainConfig`` into Lightning objects: loggers, callbacks, the Trainer.

Kept out of the recipes so that every recipe (pretrain, SFT, DPO, GRPO) builds them one way.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from data_contract.errors import ConfigError
from dsl_lit.checkpoint.directory import DirectoryCheckpointIO, StepCheckpoint, latest_checkpoint
from dsl_lit.checkpoint.resume import resume_checkpoint
from dsl_lit.config import ModelConfig, TrainConfig
from dsl_lit.config.model import CONTEXT_FIELDS
from dsl_lit.flops import training_flops_per_token
from dsl_lit.models import build_model
from dsl_lit.parallel.strategy import DeepSeekStrategy
from dsl_lit.precision.plugin import AutocastPrecision
from dsl_lit.training.callbacks.downstream_eval import DownstreamEvaluation
from dsl_lit.training.callbacks.ema import EMACallback
from dsl_lit.training.callbacks.expert_load import ExpertLoadMonitor
from dsl_lit.training.callbacks.passkey_probe import PasskeyProbe
from dsl_lit.training.callbacks.preemption import PreemptionHandler, exit_together
from dsl_lit.training.callbacks.profiler import TraceProfiler
from dsl_lit.training.callbacks.progress import StepProgressBar
from dsl_lit.training.callbacks.rank_failure import RankFailureReporter
from dsl_lit.training.callbacks.rng_state import RNGStateCallback
from dsl_lit.training.callbacks.run_log import RunLog, closing_lines
from dsl_lit.training.callbacks.throughput import ThroughputMonitor
from dsl_lit.training.loggers import RunCSVLogger
from dsl_lit.training.noise import quiet_wandb_logger, silence_known_noise
from dsl_lit.training.pretrained import StartingWeights
from dsl_lit.training.resume_command import resume_command, stop_hint
from dsl_lit.training.run_info import resolved_view
from dsl_lit.training.run_plan import run_plan
from dsl_lit.training.runs import finish_run
from dsl_lit.utils.sweep import current_job

log = logging.getLogger(__name__)



def module_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """The ``CausalLMModule`` arguments of a validated config: the one mapping from config to
    module that every recipe (pretraining, post-training, the scaling-law sweep) uses."""
    plan = run_plan(cfg)
    return dict(
        model_config=cfg.model, optim=cfg.optim, schedule=cfg.schedule, micro_batch_size=cfg.data.micro_batch_size,
        total_steps=cfg.schedule.total_steps or cfg.trainer.max_steps, objective=cfg.objective,
        precision=plan.precision, memory=cfg.memory, max_bad_steps=cfg.trainer.max_bad_steps,
        batch_schedule=cfg.data.batch_schedule, transform_plan=plan.transforms,
    )


def starting_weights(cfg: TrainConfig, source: str | None) -> StartingWeights | None:
    """The weights ``init_from`` names (None without one), opened and checked but not read: each
    rank reads its part when the model is set up. Their architecture replaces ``cfg.model``
    (re-validated with the layout), so the run's checkpoints rebuild the right model."""
    if not source:
        return None
    weights = StartingWeights.open(source).continued_as(cfg.model)  # V3.2 from a V3 checkpoint adds the indexers
    group = dict(weights.group)
    # A context-extension stage keeps the architecture but sets the positions it trains at: the
    # run's own model.max_seq_len and model.rope_scaling (fields that shape no weight) win.
    extension = {key: value for key, value in (cfg.raw.get("model") or {}).items() if key in CONTEXT_FIELDS}
    if extension:
        log.info("init_from=%s with this run's %s", source, ", ".join(f"model.{k}={v}" for k, v in extension.items()))
    refuse_ignored_model_overrides(cfg, group, source)
    group.update(extension)
    values = dict(group)  # from_name takes the fields without the preset name
    cfg.model = ModelConfig.from_name(values.pop("name"), **values)
    cfg.raw["model"], cfg.raw["init_from"], cfg.init_from = group, str(source), str(source)
    cfg.validate()
    with torch.device("meta"):
        params = build_model(cfg.model).num_params()
    log.info("starting from %s (%s, %.1fM parameters)", source, cfg.model.name, params / 1e6)
    return weights


def command_line_model_fields() -> list[str]:
    """The ``model.<field>`` keys set on this run's command line (``+``/``++`` prefixes allowed);
    empty outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    keys = (o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task if "=" in o)
    return [k[len("model."):] for k in keys if k.startswith("model.")]


def refuse_ignored_model_overrides(cfg: TrainConfig, group: dict[str, Any], source: str) -> None:
    """A ``model.<field>`` set on the command line together with ``init_from`` that would be
    dropped (the architecture is the checkpoint's; only :data:`CONTEXT_FIELDS` are the run's own)
    is a one-line error: before, ``init_from=... +model.n_layers=8`` trained the checkpoint's
    2 layers without a word."""
    model = cfg.raw.get("model") or {}
    for key in command_line_model_fields():
        if key in CONTEXT_FIELDS or key == "name" or model.get(key) == group.get(key):
            continue
        raise ConfigError(
            f"model.{key}={model.get(key)!r} is ignored with init_from={source}: the architecture is the "
            f"checkpoint's (model.{key}={group.get(key)!r}); drop it, or train from scratch without init_from"
        )


def build_loggers(cfg: TrainConfig) -> list[Logger]:
    loggers: list[Logger] = []
    if cfg.logger.csv:
        loggers.append(RunCSVLogger(cfg.run_dir))
    wandb_cfg = cfg.logger.wandb
    if wandb_cfg.enabled and wandb_cfg.mode != "disabled":
        # WANDB_MODE from the environment wins, so `wandb login` + WANDB_MODE=online goes online.
        mode = os.environ.get("WANDB_MODE", wandb_cfg.mode)
        job = current_job()
        wandb_logger = quiet_wandb_logger(WandbLogger(
            project=wandb_cfg.project, entity=wandb_cfg.entity, save_dir=cfg.run_dir,
            offline=mode == "offline", tags=list(wandb_cfg.tags), name=job.name if job else Path(cfg.run_dir).name,
            group=job.group if job else None,  # a multirun's jobs: named by their swept overrides, grouped by sweep
        ))
        loggers.append(wandb_logger)
    if loggers:
        config = resolved_view(cfg)  # the model field by field, parameter counts, layout (run_info)
        for logger in loggers:
            logger.log_hyperparams(config)
    return loggers


def checkpoint_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.run_dir) / "checkpoints"


def resume_path(cfg: TrainConfig) -> str | None:
    """``checkpoint.resume_from`` if set, else the latest complete checkpoint of this run dir."""
    latest = resume_checkpoint(cfg.checkpoint, checkpoint_dir(cfg))
    if latest is not None:
        log.info("resuming from %s", latest)
    return str(latest) if latest else None


def build_trainer(cfg: TrainConfig, extra_callbacks: list[L.Callback] | None = None) -> L.Trainer:
    silence_known_noise()  # before Lightning and W&B speak (dsl_lit.training.noise lists what)
    plan = run_plan(cfg)
    callbacks: list[L.Callback] = [
        ThroughputMonitor(
            training_flops_per_token(cfg.model, cfg.data.seq_len), plan.precision.name, cfg.trainer.peak_tflops
        ),
        *(extra_callbacks or []),
    ]
    if cfg.model.is_moe:
        callbacks.append(ExpertLoadMonitor(cfg.logger.expert_load_every_n_steps))
    if cfg.eval.every_n_steps:
        callbacks.append(DownstreamEvaluation(cfg.eval, cfg.run_dir, plan.precision.name))
    probe = cfg.eval.passkey
    if probe.every_n_steps:
        assert cfg.eval.tokenizer_dir  # EvalConfig.validate refuses a probe without one
        callbacks.append(PasskeyProbe(probe, probe.length or cfg.data.seq_len, cfg.eval.tokenizer_dir,
                                      plan.precision.name))
    if cfg.profiler.enabled:
        callbacks.append(TraceProfiler(cfg.profiler, cfg.run_dir))
    if cfg.memory.ema_decay:
        callbacks.append(EMACallback(cfg.memory.ema_decay, cfg.memory.ema_every_n_steps, cfg.memory.validate_with_ema))
    if cfg.trainer.progress_bar:
        callbacks.append(StepProgressBar(refresh_rate=1))
    ckpt = cfg.checkpoint
    if ckpt.enabled:
        callbacks.append(StepCheckpoint(checkpoint_dir(cfg), ckpt.every_n_steps, ckpt.every_minutes))
    callbacks.append(RNGStateCallback())
    callbacks.append(RankFailureReporter(checkpoint_dir(cfg), resume=stop_hint(cfg)))
    callbacks.append(PreemptionHandler())  # before the checkpoint callback (Lightning runs those last)
    callbacks.append(RunLog())  # after every callback that logs (its lines read this step's values) and the preemption's
    # One strategy for every world size (one process: no process group, the trivial mesh), so every
    # run saves and loads the same sharded, layout-independent checkpoints the same way.
    strategy = DeepSeekStrategy(cfg.layout, timeout=timedelta(seconds=cfg.trainer.collective_timeout_s))
    return L.Trainer(
        accelerator=cfg.trainer.accelerator,
        strategy=strategy,
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        max_steps=cfg.trainer.max_steps,
        max_epochs=-1,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        logger=build_loggers(cfg) or False,
        callbacks=callbacks,
        enable_checkpointing=ckpt.enabled,
        enable_progress_bar=cfg.trainer.progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=cfg.trainer.val_every_n_steps or None,
        check_val_every_n_epoch=None if cfg.trainer.val_every_n_steps else 1,
        limit_val_batches=None if cfg.trainer.val_every_n_steps else 0,
        inference_mode=False,  # no_grad, not inference tensors: pipeline buffers outlive validation
        use_distributed_sampler=False,  # our sampler shards by data-parallel rank, deterministically
        plugins=[
            DirectoryCheckpointIO(cfg.raw, async_save=ckpt.async_save, keep_last=ckpt.keep_last,
                                  fall_back=not ckpt.resume_from),  # a named checkpoint does not fall back
            AutocastPrecision(plan.precision.name, plan.device_type),
        ],
        default_root_dir=cfg.run_dir,
    )


def fit(cfg: TrainConfig, module: L.LightningModule, datamodule: L.LightningDataModule) -> L.Trainer:
    """Build the trainer and fit, resuming from the run dir's latest checkpoint. A SIGTERM leaves
    the current step's checkpoint and exits 143; a bad-step stop (``trainer.max_bad_steps``
    non-finite steps in a row) exits 1 with the last good checkpoint intact. Either logs one line
    ending with the run dir and the command that resumes it (:func:`stop_hint`: the run's resolved
    ``run_name`` pinned; rerunning a command whose ``run_name`` is the default start time would start
    a new run)."""
    trainer = build_trainer(cfg)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_path(cfg))
    except SIGTERMException:
        if trainer.is_global_zero:
            log.warning("SIGTERM at step %d: checkpoint saved; %s", trainer.global_step, stop_hint(cfg))
        exit_together(143)
    except FloatingPointError as error:  # raised by CausalLMModule._guard_bad_steps, before any bad update or save
        if trainer.is_global_zero:
            log.error("stopped at step %d: %s; %s", trainer.global_step, error, stop_hint(cfg))
        exit_together(1)
    if trainer.is_global_zero:
        for line in closing_lines(trainer, next((c for c in trainer.callbacks if isinstance(c, RunLog)), None),
                                  cfg.run_dir, final_checkpoint(cfg), resume_command(cfg)):
            log.info(line)
    finish_run(trainer)
    return trainer


def final_checkpoint(cfg: TrainConfig) -> str:
    """The run's latest complete checkpoint, or why there is none (for the closing summary)."""
    if not cfg.checkpoint.enabled:
        return "none (checkpoint.every_n_steps=0 and checkpoint.every_minutes=0)"
    latest = latest_checkpoint(checkpoint_dir(cfg))
    return str(latest) if latest is not None else f"none complete in {checkpoint_dir(cfg)}"
