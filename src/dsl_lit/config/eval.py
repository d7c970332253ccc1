"""Downstream evaluation with EleutherAI's lm-evaluation-harness: the ``eval`` group of the
training recipes (tasks run inside the training loop every N steps) and the options of
``recipes/evaluate.py`` (tasks run on a checkpoint).

Task names resolve against the bundled tasks (``data/eval_tasks``), the directories in
``include_path`` and, with ``include_defaults``, lm-eval's own task library (which downloads its
datasets from the Hugging Face hub, so it is off by default: nothing is downloaded at run time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from data_contract.errors import ConfigError


@dataclass
class EvalTasksConfig:
    """What to evaluate and how; shared by the ``eval`` group and ``recipes/evaluate.py``.

    ``limit``: at most this many documents per task (a fraction below 1: that share), null: all.
    ``num_fewshot`` null keeps each task's own setting. ``max_gen_toks`` is the default length of
    a generation when a task does not set one (lm-eval's ``hf`` backend uses 256 too).
    ``bootstrap_iters`` 0 skips the bootstrapped standard errors (reported as "N/A").
    ``tokenizer_dir``: a directory with ``tokenizer.json`` (null: where the model came from).
    """

    FIELD_PREFIX: ClassVar[str] = "eval."
    """How errors name a field: ``eval.limit`` in the training recipes' group, ``limit`` on the
    evaluate recipe's command line."""

    tasks: list[str] = field(default_factory=list)
    include_path: list[str] | str = field(default_factory=list)
    include_defaults: bool = False
    limit: float | None = None
    num_fewshot: int | None = None
    batch_size: int = 16
    max_gen_toks: int = 256
    bootstrap_iters: int = 0
    log_samples: bool = False
    tokenizer_dir: str | None = None
    seed: int = 1234

    @property
    def include_paths(self) -> list[str]:
        return [self.include_path] if isinstance(self.include_path, str) else list(self.include_path)

    def validate(self) -> EvalTasksConfig:
        prefix = self.FIELD_PREFIX
        if not all(isinstance(name, str) and name for name in self.tasks):
            raise ConfigError(f"{prefix}tasks={self.tasks!r} must be a list of task names, e.g. [dsl_arithmetic]")
        for name in ("batch_size", "max_gen_toks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}{name}={getattr(self, name)} must be >= 1")
        if self.bootstrap_iters < 0:
            raise ConfigError(f"{prefix}bootstrap_iters={self.bootstrap_iters} must be >= 0 (0: no stderr)")
        if self.limit is not None and not self.limit > 0:
            raise ConfigError(f"{prefix}limit={self.limit} must be > 0 (documents per task, or a fraction < 1)")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"{prefix}num_fewshot={self.num_fewshot} must be >= 0 (or null: the task's own)")
        return self


@dataclass
class PasskeyProbeConfig:
    """Passkey retrieval measured inside the training loop (``eval.passkey``): every
    ``every_n_steps`` optimizer steps, ``per_depth`` prompts at each key depth of ``length`` tokens
    (null: the run's ``data.seq_len``), logged as ``eval/passkey/<length>``. With ``stop_at``, the
    run stops (and saves) at the first probe that retrieves at least that share: a small model learns
    retrieval abruptly, at a step that moves by hundreds with the seed, so a context-extension base
    is trained until it retrieves rather than for a fixed count (``trainer.max_steps`` the cap).
    ``seed`` draws the prompts: keep it apart from the seed the run is later scored with
    (``recipes/passkey.py``'s default is 0), so the stopping rule never sees the test prompts."""

    every_n_steps: int = 0
    length: int | None = None
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    per_depth: int = 8
    seed: int = 101
    stop_at: float | None = None

    def validate(self) -> PasskeyProbeConfig:
        if self.every_n_steps < 0:
            raise ConfigError(f"eval.passkey.every_n_steps={self.every_n_steps} must be >= 0 (0: never)")
        if self.stop_at is not None and not (0.0 < self.stop_at <= 1.0 and self.every_n_steps):
            raise ConfigError(f"eval.passkey.stop_at={self.stop_at} needs a share in (0, 1] and "
                              "eval.passkey.every_n_steps > 0 (the probe that decides it)")
        if self.length is not None and self.length < 48:
            raise ConfigError(f"eval.passkey.length={self.length} must be at least 48 tokens (one prompt), or null")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(f"eval.passkey.depths={self.depths} must be fractions in [0, 1]")
        if self.per_depth < 1:
            raise ConfigError(f"eval.passkey.per_depth={self.per_depth} must be at least 1")
        return self


@dataclass
class EvalConfig(EvalTasksConfig):
    """The ``eval`` group of the training recipes: run ``tasks`` every ``every_n_steps`` optimizer
    steps (0: never) on the current weights, logged as ``eval/<task>/<metric>``; lm-eval's
    results.json of each evaluation goes to ``<run dir>/eval/step-<N>/``."""

    every_n_steps: int = 0
    passkey: PasskeyProbeConfig = field(default_factory=PasskeyProbeConfig)

    def validate(self) -> EvalConfig:
        super().validate()
        self.passkey.validate()
        if self.passkey.every_n_steps and not self.tokenizer_dir:
            raise ConfigError("eval.tokenizer_dir is empty: the passkey probe needs the run's tokenizer "
                              "(the default is ${data.cache_dir}/tokenizer)")
        if self.every_n_steps < 0:
            raise ConfigError(f"eval.every_n_steps={self.every_n_steps} must be >= 0 (0 disables evaluation)")
        if self.every_n_steps and not self.tasks:
            raise ConfigError(f"eval.every_n_steps={self.every_n_steps} but eval.tasks is empty; name the tasks, "
                              "e.g. eval.tasks=[dsl_kjv_next_sentence,dsl_arithmetic]")
        if self.every_n_steps and not self.tokenizer_dir:
            raise ConfigError("eval.tokenizer_dir is empty: point it at the run's tokenizer "
                              "(the default is ${data.cache_dir}/tokenizer)")
        return self
