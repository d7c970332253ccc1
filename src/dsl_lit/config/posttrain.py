"""Config groups of the post-training recipes (SFT, DPO, GRPO, rejection sampling, distillation),
validated at start-up like ``TrainConfig``: every error names the field and the fix.

They sit beside the shared groups (model, data, optim, ...): ``TrainConfig`` reads those, and
:meth:`PostTrainConfig.from_raw` reads these from the same resolved Hydra config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
ADVANTAGE_SCALES = ("group", "batch", "none")
REWARDS = ("accuracy", "format", "language", "restatement")
"""Names of the rule rewards (``dsl_lit.posttrain.rewards.REWARD_FUNCTIONS`` has one function per name)."""
TASK_OPERATIONS = ("+", "-", "*", "largest")
"""Operations the generated arithmetic task can draw (``dsl_lit.tasks.arithmetic``): binary ones on two
operands, ``largest`` over ``task.list_length`` of them."""


@dataclass
class TaskConfig:
    """``task`` group: which generated problems the post-training recipes use."""

    name: str = "arithmetic"
    num_problems: int = 800
    eval_problems: int = 64
    max_operand: int = 20
    operations: list[str] = field(default_factory=lambda: ["+", "-"])
    list_length: int = 4
    """Numbers in a ``largest`` problem."""
    uniform_largest: bool = False
    """Draw each ``largest`` list around its largest number, uniform over 0..max_operand (and its
    place uniform), instead of every number uniform: then no single answer is right more often than
    about 1 in (max_operand + 1). With every number uniform, "9" is the largest of ~34% of lists of
    four digits, a constant a policy rewarded on accuracy drifts to (measured: ``make reproduce``)."""
    seed: int = 0
    language: str = "en"

    def available(self) -> int:
        """How many distinct problems the operations and operand range allow."""
        values = self.max_operand + 1
        return sum(values ** (self.list_length if op == "largest" else 2) for op in self.operations)

    def validate(self) -> TaskConfig:
        if self.name != "arithmetic":
            raise ConfigError(f"task.name={self.name!r} is unknown; the bundled task is 'arithmetic'")
        bad = [op for op in self.operations if op not in TASK_OPERATIONS]
        if bad or not self.operations:
            raise ConfigError(f"task.operations={self.operations} must be a non-empty subset of {list(TASK_OPERATIONS)}")
        if self.max_operand < 1:
            raise ConfigError(f"task.max_operand={self.max_operand} must be >= 1")
        if self.list_length < 2:
            raise ConfigError(f"task.list_length={self.list_length} must be >= 2")
        available = self.available()
        if not 0 < self.num_problems <= available:
            raise ConfigError(f"task.num_problems={self.num_problems} must be in [1, {available}] (distinct "
                              f"problems with operands up to task.max_operand={self.max_operand})")
        if not 0 <= self.eval_problems < self.num_problems:
            raise ConfigError(f"task.eval_problems={self.eval_problems} must be in [0, task.num_problems)")
        return self




@dataclass
class SFTConfig:
    dataset: str = "task"
    """``task``: the generated task's reference replies; else a .jsonl (or a ``datasets`` save_to_disk
    directory) of TRL's rows: ``{"messages": [...]}``, ``{"prompt", "completion"}`` or ``{"text"}``."""
    packing: bool | None = None
    """Pack conversations into rows with per-document positions and attention; null: pack where the
    model's attention follows packed documents (every family but DeepSeek-V4), resolved by
    ``TrainConfig.validate``."""
    epochs: float | None = None
    """When set, trainer.max_steps is derived from it (passes over the data)."""
    shortcut_share: float = 0.0
    """With ``dataset: task``: this share of the replies answer by the task's shortcut rule, an
    imperfect cold start that RL has room to improve (as GRPO's own cold start does)."""

    def validate(self) -> SFTConfig:
        if not self.dataset:
            raise ConfigError("sft.dataset is empty: use 'task' or a path to a .jsonl of conversations")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"sft.epochs={self.epochs} must be > 0 (or null to use trainer.max_steps)")
        if not 0.0 <= self.shortcut_share <= 1.0:
            raise ConfigError(f"sft.shortcut_share={self.shortcut_share} must be in [0, 1]")
        if self.shortcut_share and self.dataset != "task":
            raise ConfigError(f"sft.shortcut_share={self.shortcut_share} needs sft.dataset=task (the generated "
                              f"task's replies), not {self.dataset!r}")
        return self


@dataclass
class DPOConfig:
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: str = "precompute"
    """``precompute``: reference log-probs computed once from the initial weights and cached with
    the data; ``model``: a frozen copy of the initial model run beside the policy every step."""
    num_pairs: int = 512
    """With ``dataset: task``: how many generated pairs."""
    dataset: str = "task"
    """``task`` (generated pairs) or a JSONL of TRL's preference rows: ``{"prompt", "chosen",
    "rejected"}``, each a string or a list of messages (a line that is neither is set aside)."""

    def validate(self) -> DPOConfig:
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta={self.beta} must be > 0 (DPO's KL strength; 0.1 is usual)")
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ConfigError(f"dpo.loss_type={self.loss_type!r} is unknown; choose one of {DPO_LOSS_TYPES}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.reference not in ("precompute", "model"):
            raise ConfigError(f"dpo.reference={self.reference!r} must be 'precompute' or 'model'")
        if self.num_pairs < 1:
            raise ConfigError(f"dpo.num_pairs={self.num_pairs} must be >= 1")
        if self.dataset != "task" and not Path(self.dataset).exists():
            raise ConfigError(f"dpo.dataset={self.dataset}: no such file or directory (use 'task', a .jsonl of "
                              "{\"prompt\", \"chosen\", \"rejected\"} rows or a datasets save_to_disk directory)")
        return self


@dataclass
class SamplingConfig:
    """How completions are sampled (GRPO rollouts, rejection sampling, distillation)."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    def validate(self, prefix: str = "sampling") -> SamplingConfig:
        if self.max_new_tokens < 1:
            raise ConfigError(f"{prefix}.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"{prefix}.temperature={self.temperature} must be >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{prefix}.top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"{prefix}.top_k={self.top_k} must be >= 1 or null")
        return self


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: a prompt group whose completions all earn the same reward has zero
    advantage, so it only dilutes the batch. Such groups are dropped and more prompts are drawn
    until the batch holds ``data.global_batch_size`` informative groups again."""

    enabled: bool = False
    max_draws: int = 4
    """Prompt batches sampled per step at most, the data's own batch included; when the cap is
    reached short of a full batch, dropped groups fill the rest (logged as grpo/filled_groups)."""

    def validate(self) -> DynamicSamplingConfig:
        if self.max_draws < 1:
            raise ConfigError(f"grpo.dynamic_sampling.max_draws={self.max_draws} must be >= 1 "
                              "(prompt batches sampled per step, the first included)")
        return self


@dataclass
class RolloutCorrectionConfig:
    """Correction for the sampler's forward not being the training forward (``dsl_lit.posttrain.grpo.
    rollout_correction``); the mismatch itself is logged whatever these are (``train/rollout_*``)."""

    token_cap: float | None = None
    """Token-level truncated importance sampling: each token's policy loss times min(r, token_cap),
    r = p_train / p_rollout (verl's default cap: 2); null: off."""
    sequence_bounds: list[float] | None = None
    """Sequence-level masking: [lo, hi]; a completion whose ratio prod_t r_t leaves it adds no policy
    loss (e.g. [0.5, 2.0]); null: off."""

    def validate(self) -> RolloutCorrectionConfig:
        if self.token_cap is not None and self.token_cap < 1:
            raise ConfigError(f"grpo.rollout_correction.token_cap={self.token_cap} must be >= 1 (a cap on r = "
                              "p_train / p_rollout; 1 would discount every token the trainer likes more) or null")
        if self.sequence_bounds is not None:
            bounds = list(self.sequence_bounds)
            if len(bounds) != 2 or not 0 < bounds[0] < 1 < bounds[1]:
                raise ConfigError(f"grpo.rollout_correction.sequence_bounds={bounds} must be [lo, hi] with "
                                  "0 < lo < 1 < hi (e.g. [0.5, 2.0]) or null")
        return self


@dataclass
class OverlongConfig:
    """DAPO's handling of completions that hit the length budget."""

    filter: bool = False
    """Mask the loss of truncated completions (no end-of-sequence token within
    ``grpo.sampling.max_new_tokens``): a cut reasoning is not penalised for being cut."""
    penalty_cache: int = 0
    """L_cache of the soft overlong punishment: a completion longer than ``max_length - penalty_cache``
    tokens gets a reward penalty growing linearly to -1 at ``max_length`` (and -1 beyond); 0: off."""
    max_length: int | None = None
    """L_max; null: ``grpo.sampling.max_new_tokens``."""

    def validate(self) -> OverlongConfig:
        if self.penalty_cache < 0:
            raise ConfigError(f"grpo.overlong.penalty_cache={self.penalty_cache} must be >= 0 (0: no length penalty)")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"grpo.overlong.max_length={self.max_length} must be >= 1 "
                              "or null (grpo.sampling.max_new_tokens)")
        return self


@dataclass
class GRPOConfig:
    group_size: int = 8
    """G: completions sampled per prompt (R1-Zero: 16)."""
    iterations: int = 1
    """mu: optimizer steps on each batch of completions (the clipped ratio matters when > 1)."""
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.001
    """KL coefficient to the reference (R1: 0.001); 0 drops the reference model."""
    ref_refresh_steps: int = 400
    """The reference becomes the current policy every N optimizer steps (R1: 400); 0: never."""
    loss_type: str = "grpo"
    """How token losses become one: ``grpo`` (per completion, then mean), ``bnpo`` (per token),
    ``dr_grpo`` (sum / (completions x max length)), ``dapo`` (sum / the step's tokens), ``cispo``
    (MiniMax-M1: the policy gradient weighted by the ratio capped at 1 + eps_high and detached, so
    every token keeps a gradient; normalised as dapo)."""
    importance_sampling: str = "token"
    """``token``: a ratio per token (GRPO, PPO); ``sequence``: GSPO (Qwen3), one ratio per completion,
    ``exp(mean of its tokens' log-ratios)``, clipped as a whole (TRL's ``importance_sampling_level``)."""
    advantage_scale: str = "group"
    rewards: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0, "format": 0.5})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    cold_start_steps: int = 0
    """Without init_from: first SFT the random model this many steps on the task's reference
    replies (R1's cold start), then run GRPO from it; 0 starts GRPO from the random model."""
    cold_start_lr: float = 3e-3
    cold_start_shortcut: float = 0.0
    """Share of the cold start's replies that answer by the task's shortcut rule (the question's last
    number) instead of the right answer: an imperfect cold start, as real ones are."""
    eval_every_n_steps: int = 0
    """Greedy accuracy on the held-out problems every N steps (0: only at the start and the end)."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    routing_replay: bool = False
    """Rollout routing replay (R3) for MoE models: the training forwards send each token to the experts
    the sampler sent it to (the router's scores of those experts still get gradients), so the ratio
    compares one network with itself. Off, the router-flip rate is still measured and logged."""
    dataset: str = "task"
    """``task`` (the generated task's problems) or a JSONL of prompts with reference answers:
    ``{"prompt": str or messages, "answer": str, "checker": "exact" | "numeric" | "boxed"}`` (checker
    optional: the accuracy reward's default); no held-out evaluation then."""

    @property
    def overlong_max_length(self) -> int:
        """L_max of the soft overlong punishment."""
        return self.overlong.max_length or self.sampling.max_new_tokens

    def validate(self) -> GRPOConfig:
        if self.group_size < 2:
            raise ConfigError(f"grpo.group_size={self.group_size} must be >= 2 (advantages compare a group)")
        if self.iterations < 1:
            raise ConfigError(f"grpo.iterations={self.iterations} must be >= 1")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ConfigError(f"grpo.eps_low={self.eps_low} must be in [0, 1) and grpo.eps_high={self.eps_high} >= 0")
        if self.beta < 0:
            raise ConfigError(f"grpo.beta={self.beta} must be >= 0")
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ConfigError(f"grpo.loss_type={self.loss_type!r} is unknown; choose one of {GRPO_LOSS_TYPES}")
        if self.importance_sampling not in IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(f"grpo.importance_sampling={self.importance_sampling!r} is unknown; choose one of "
                              f"{IMPORTANCE_SAMPLING_LEVELS} (sequence: GSPO)")
        if self.advantage_scale not in ADVANTAGE_SCALES:
            raise ConfigError(f"grpo.advantage_scale={self.advantage_scale!r} is unknown; choose one of {ADVANTAGE_SCALES}")
        unknown = sorted(set(self.rewards) - set(REWARDS))
        if unknown or not any(self.rewards.values()):
            raise ConfigError(f"grpo.rewards={self.rewards} must give a non-zero weight to some of {sorted(REWARDS)}")
        if self.cold_start_lr <= 0:
            raise ConfigError(f"grpo.cold_start_lr={self.cold_start_lr} must be > 0")
        if not 0 <= self.cold_start_shortcut < 1:
            raise ConfigError(f"grpo.cold_start_shortcut={self.cold_start_shortcut} must be in [0, 1)")
        for name in ("ref_refresh_steps", "cold_start_steps", "eval_every_n_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"grpo.{name}={getattr(self, name)} must be >= 0")
        self.sampling.validate("grpo.sampling")
        self.dynamic_sampling.validate()
        self.overlong.validate()
        self.rollout_correction.validate()
        if self.dataset != "task":
            if not Path(self.dataset).exists():
                raise ConfigError(f"grpo.dataset={self.dataset}: no such file or directory (use 'task', a .jsonl of "
                                  "{\"prompt\", \"answer\"} rows or a datasets save_to_disk directory)")
            if self.cold_start_steps:
                raise ConfigError(f"grpo.dataset={self.dataset} with grpo.cold_start_steps={self.cold_start_steps}: the "
                                  "cold start trains on the generated task's replies; set grpo.cold_start_steps=0 and "
                                  "init_from=<a checkpoint SFT-ed for your prompts>")
        if self.overlong.penalty_cache > self.overlong_max_length:
            source = "grpo.overlong.max_length" if self.overlong.max_length else "grpo.sampling.max_new_tokens"
            raise ConfigError(f"grpo.overlong.penalty_cache={self.overlong.penalty_cache} must be <= L_max = "
                              f"{source}={self.overlong_max_length}: the penalty ramps over the last "
                              "penalty_cache tokens before L_max")
        return self


@dataclass
class RejectionConfig:
    """Rejection sampling / distillation data: k samples per prompt, the verified ones kept."""

    samples_per_prompt: int = 8
    num_prompts: int = 256
    keep_per_prompt: int = 1
    """At most this many accepted completions per prompt (distinct ones first)."""
    min_reward: float = 1.0
    """A completion is kept when its reward reaches this (accuracy + format must both hold at 1.0
    with the default weights below, scaled to a maximum of 1)."""
    rewards: dict[str, float] = field(default_factory=lambda: {"accuracy": 0.5, "format": 0.5})
    verify: bool = True
    """false keeps every sample (plain distillation, no verifier)."""
    batch_prompts: int = 32
    output: str = "samples.jsonl"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def validate(self) -> RejectionConfig:
        for name in ("samples_per_prompt", "num_prompts", "keep_per_prompt", "batch_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rejection.{name}={getattr(self, name)} must be >= 1")
        unknown = sorted(set(self.rewards) - set(REWARDS))
        if unknown:
            raise ConfigError(f"rejection.rewards has unknown reward(s) {unknown}; known: {sorted(REWARDS)}")
        self.sampling.validate("rejection.sampling")
        return self


_SECTIONS: dict[str, type] = {"task": TaskConfig, "sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig,
                              "rejection": RejectionConfig}


@dataclass
class PostTrainConfig:
    tokenizer_dir: str = ""
    chat_template_name: str | None = None
    """One of the tokenizer's named chat templates (tokenizer_config.json's list); null: its default."""
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rejection: RejectionConfig = field(default_factory=RejectionConfig)

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> PostTrainConfig:
        values: dict[str, Any] = {"tokenizer_dir": raw.get("tokenizer_dir") or "",
                                  "chat_template_name": raw.get("chat_template_name")}
        for key, value in values.items():  # top-level keys: no dataclass_from_dict to check their type
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{key}={value!r} must be one name (a string), not a {type(value).__name__}")
        for name, schema in _SECTIONS.items():
            section = dict(raw.get(name) or {})
            if "sampling" in section:
                section["sampling"] = dataclass_from_dict(SamplingConfig, dict(section["sampling"] or {}), f"{name}.sampling")
            values[name] = dataclass_from_dict(schema, section, name)
        config = cls(**values)
        if not config.tokenizer_dir:
            raise ConfigError("tokenizer_dir is empty: point it at a directory with tokenizer.json "
                              "(the default is the bundled data's ${data.cache_dir}/tokenizer)")
        return config
