"""The typed, validated form of a recipe's Hydra config.

Hydra composes YAML; ``TrainConfig.from_hydra`` turns each group into its dataclass, checks types
and values, and raises ``ConfigError`` naming the field (``optim.lr=-1.0 must be > 0``) before a
Trainer, a process group or a dataset exists.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict
from dsl_lit.config.data import DataConfig
from dsl_lit.config.eval import EvalConfig
from dsl_lit.config.memory import MemoryConfig
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.objective import ObjectiveConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.parallel import ParallelConfig, ParallelLayout, check_context_parallel_seq_len
from dsl_lit.config.posttrain import PostTrainConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.config.profiler import ProfilerConfig
from dsl_lit.config.resolvers import register_resolvers


@dataclass
class WandbConfig:
    enabled: bool = True
    project: str = "dsl-lit"
    mode: str = "offline"
    entity: str | None = None
    tags: list[str] = field(default_factory=list)

    def validate(self) -> WandbConfig:
        if self.mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"logger.wandb.mode={self.mode!r} must be offline, online or disabled")
        return self


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv: bool = True
    expert_load_every_n_steps: int = 50
    """How often the per-layer expert-load heatmap goes to W&B (0: never); scalars log every step."""


@dataclass
class CheckpointConfig:
    """``checkpoint`` group: save under ``<run dir>/checkpoints/step-<N>/`` every N optimizer steps
    and/or every M minutes (either 0 disables that trigger; both 0 disable saving), and after the
    last step. ``async_save`` writes on a background thread after a synchronous CPU copy;
    ``keep_last`` keeps only the newest complete checkpoints (0 or null: all)."""

    every_n_steps: int = 100
    every_minutes: float = 5.0
    async_save: bool = True
    keep_last: int | None = 3
    resume: bool = True
    resume_from: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.every_n_steps or self.every_minutes)

    def validate(self) -> CheckpointConfig:
        if self.every_n_steps < 0:
            raise ConfigError(f"checkpoint.every_n_steps={self.every_n_steps} must be >= 0 (0 disables the step trigger)")
        if not math.isfinite(self.every_minutes) or self.every_minutes < 0:
            raise ConfigError(
                f"checkpoint.every_minutes={self.every_minutes} must be a finite number >= 0 (0 disables the time trigger)"
            )
        if self.keep_last is not None and self.keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 0 (0 or null keeps every checkpoint)")
        return self


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""``torch.compile`` backends a run may name (``torch._dynamo.list_backends()`` plus the debugging ones)."""

@dataclass
class TrainerConfig:
    max_steps: int = 100
    devices: int = 1
    num_nodes: int = 1
    accelerator: str = "auto"
    log_every_n_steps: int = 1
    seed: int = 1234
    peak_tflops: float | None = None
    progress_bar: bool = True
    val_every_n_steps: int = 0
    """Validate on ``data.val_windows`` every N optimizer steps (0: never)."""
    max_bad_steps: int = 10
    """Stop after this many optimizer steps in a row with non-finite gradients (0: never stop)."""
    collective_timeout_s: float = 1800.0
    """A collective that waits longer than this for a rank (hung, or cut off) fails and stops the run."""
    compile: bool | None = None
    """Compile each transformer block with ``torch.compile`` (after FP8, recompute and sharding);
    null: on when training on CUDA, off on CPU (inductor's CPU code is not faster for these tiny
    models and compiling costs a minute)."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend (torchtitan's ``compile.backend``): ``inductor`` generates
    fused kernels; ``aot_eager`` traces the same graphs (Dynamo and AOTAutograd: graph breaks,
    recompiles, the transform order) and runs them with eager kernels, without code generation."""

    def validate(self) -> TrainerConfig:
        for name in ("max_steps", "devices", "num_nodes", "log_every_n_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be >= 1")
        if self.accelerator not in ("auto", "cpu", "gpu", "cuda"):
            raise ConfigError(f"trainer.accelerator={self.accelerator!r} must be auto, cpu, gpu or cuda")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(f"trainer.compile_backend={self.compile_backend!r} is not one of {COMPILE_BACKENDS}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"trainer.collective_timeout_s={self.collective_timeout_s} must be > 0 (seconds)")
        if self.max_bad_steps < 0:
            raise ConfigError(f"trainer.max_bad_steps={self.max_bad_steps} must be >= 0 (0 never stops)")
        if self.val_every_n_steps < 0:
            raise ConfigError(f"trainer.val_every_n_steps={self.val_every_n_steps} must be >= 0 (0 disables validation)")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"trainer.peak_tflops={self.peak_tflops} must be > 0 (or null to detect it)")
        return self


@dataclass
class TrainConfig:
    """Everything a pretraining run needs, validated. ``raw`` keeps the resolved dict for logging."""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    precision: PrecisionConfig
    parallel: ParallelConfig
    logger: LoggerConfig
    checkpoint: CheckpointConfig
    trainer: TrainerConfig
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    init_from: str | None = None
    """Starting weights only (fresh optimizer, schedule and data position): one of our checkpoints
    (a step-<N> or run directory) or a Hugging Face directory; its architecture replaces ``model``."""
    run_dir: str = "."
    raw: dict[str, Any] = field(default_factory=dict)
    post: PostTrainConfig | None = None
    """The post-training sections, for the post-training recipes."""
    layout: ParallelLayout | None = None
    """Set by :meth:`validate`: the parallel layout of ``world_size`` processes."""

    @classmethod
    def from_hydra(cls, cfg: DictConfig, run_dir: str = ".", post_training: bool = False) -> TrainConfig:
        """Parse and validate every group of ``cfg`` once; ``post_training`` also parses the
        post-training sections (``init_from``, ``tokenizer_dir``, ``task``, ``sft``, ...) into :attr:`post`."""
        register_resolvers()
        raw = typing.cast(dict, OmegaConf.to_container(cfg, resolve=True))
        model_values = dict(raw.get("model") or {})
        if "name" not in model_values:
            raise ConfigError("model.name is missing; pick a preset, e.g. model=deepseek_llm_tiny")
        model = ModelConfig.from_name(model_values.pop("name"), **model_values)
        model.refuse_unused(model_values)
        logger_values = dict(raw.get("logger") or {})
        logger = LoggerConfig(
            wandb=dataclass_from_dict(WandbConfig, dict(logger_values.pop("wandb", None) or {"enabled": False}),
                                      "logger.wandb"),
            csv=bool(logger_values.pop("csv", True)),
            expert_load_every_n_steps=int(logger_values.pop("expert_load_every_n_steps", 50)),
        )
        groups: dict[str, Any] = {}
        for name, schema in (("data", DataConfig), ("optim", OptimConfig), ("schedule", ScheduleConfig),
                             ("precision", PrecisionConfig), ("parallel", ParallelConfig),
                             ("checkpoint", CheckpointConfig), ("trainer", TrainerConfig),
                             ("objective", ObjectiveConfig), ("memory", MemoryConfig), ("eval", EvalConfig),
                             ("profiler", ProfilerConfig)):
            groups[name] = dataclass_from_dict(schema, dict(raw.get(name) or {}), name)
        post = PostTrainConfig.from_raw(raw) if post_training else None
        config = cls(model=model, logger=logger, run_dir=run_dir, raw=raw, post=post,
                     init_from=raw.get("init_from") or None, **groups)
        return config.validate()

    @property
    def world_size(self) -> int:
        return self.trainer.devices * self.trainer.num_nodes

    def validate(self) -> TrainConfig:
        """Checks that span groups."""
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                "lower data.seq_len or raise +model.max_seq_len"
            )
        self.layout = ParallelLayout.create(self.parallel, self.model, self.world_size)
        dp = self.layout.dp
        if self.precision.fp8 and self.parallel.tp > 1:
            raise ConfigError(
                f"precision.fp8={self.precision.fp8} with parallel.tp={self.parallel.tp} is not supported yet "
                "(FP8 linears do not take tensor-parallel weights); use parallel.tp=1"
            )
        if self.trainer.compile and self.parallel.tp > 1:
            raise ConfigError(
                f"trainer.compile=true with parallel.tp={self.parallel.tp} is not supported yet (compiled blocks hand "
                "back plain-tensor gradients where tensor parallelism's DTensors expect DTensors); set "
                "trainer.compile=false (null compiles only where it works)"
            )
        if self.parallel.sequence_parallel and self.data.seq_len % self.parallel.tp:
            raise ConfigError(
                f"parallel.sequence_parallel=true shards data.seq_len={self.data.seq_len} over parallel.tp="
                f"{self.parallel.tp} ranks; make data.seq_len a multiple of it"
            )
        if self.parallel.cp > 1 and self.post is not None:
            raise ConfigError(
                f"parallel.cp={self.parallel.cp} is built for pretraining (recipes/pretrain.py); post-training rows "
                "carry their own positions and attention masks, which context parallelism does not shard yet; "
                "use parallel.cp=1"
            )
        if self.post is not None and self.post.grpo.routing_replay and not self.model.is_moe:
            raise ConfigError(f"grpo.routing_replay=true replays which experts each token was routed to, but model "
                              f"{self.model.name} has no routed experts; drop grpo.routing_replay or pick an MoE model")
        if self.model.sparse_attention and self.model.index_training == "warmup" and not self.init_from:
            raise ConfigError("model.index_training=warmup trains only the indexers, against the attention of a "
                              "trained model, and freezes the rest: set init_from to a deepseek_v3 (or deepseek_v32) "
                              "checkpoint, e.g. init_from=outputs/pretrain/<run_name>")
        if self.post is not None:
            if self.post.sft.packing is None:
                self.post.sft.packing = self.model.packs_documents
            elif self.post.sft.packing and not self.model.packs_documents:
                raise ConfigError(f"sft.packing=true with model {self.model.name} (family {self.model.family}): its "
                                  "attention does not follow packed documents yet; set sft.packing=false")
        for dim, why in self.model.unsupported_parallel.items():
            value = getattr(self.parallel, dim)
            if value is True or (not isinstance(value, bool) and value > 1):
                off = "false" if isinstance(value, bool) else "1"
                raise ConfigError(f"parallel.{dim}={str(value).lower()} with model {self.model.name} "
                                  f"(family {self.model.family}) is not supported yet: {why}; set parallel.{dim}={off}")
        check_context_parallel_seq_len(self.parallel.cp, self.data.seq_len)
        self.data.validate(dp_size=dp)
        self.layout.check_micro_batches(self.data.smallest_global_batch, self.data.micro_batch_size)
        if self.trainer.val_every_n_steps and self.data.val_windows < self.data.validation_batch:
            which = "val_batch_size" if self.data.val_batch_size else "global_batch_size"
            raise ConfigError(
                f"trainer.val_every_n_steps={self.trainer.val_every_n_steps} needs held-out data: set data.val_windows "
                f"to at least data.{which}={self.data.validation_batch} (now {self.data.val_windows})"
            )
        probe = self.eval.passkey
        if probe.every_n_steps and (probe.length or self.data.seq_len) > self.model.max_seq_len:
            raise ConfigError(f"eval.passkey.length={probe.length} exceeds model.max_seq_len={self.model.max_seq_len}; "
                              "probe at most the trained length (null: data.seq_len)")
        if self.profiler.enabled and self.profiler.steps_per_cycle > self.trainer.max_steps:
            raise ConfigError(
                f"profiler.wait+warmup+active={self.profiler.steps_per_cycle} exceeds trainer.max_steps="
                f"{self.trainer.max_steps}: no trace would be written; lower profiler.wait or profiler.warmup"
            )
        if self.data.tokenizer_vocab_size > self.model.vocab_size:
            raise ConfigError(
                f"data.tokenizer_vocab_size={self.data.tokenizer_vocab_size} exceeds "
                f"model.vocab_size={self.model.vocab_size}; the embedding must cover every token id"
            )
        return self
