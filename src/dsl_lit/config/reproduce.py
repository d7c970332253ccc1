"""Options of ``recipes/reproduce.py``: DeepSeek's method end to end, one stage after another.

The stages, what each feeds the next and what each reads live in one table,
:mod:`dsl_lit.config.reproduce_stages` (their work in :mod:`dsl_lit.reproduce.stages`); a
preset (``conf/reproduce/<name>.yaml``) gives the budget of the pretraining, per-stage Hydra
overrides of the recipes (step counts, model sizes) and the measured seconds per stage that the
progress line's estimate uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from data_contract.errors import ConfigError
from dsl_lit.config.reproduce_stages import CONTEXT_LENGTHS, STAGES

MAX_PRETRAIN_TOKENS = 10**10
"""A miniature's ceiling (gpu_small trains ~10^8 tokens): above it the start-up arithmetic of the
stages' schedules runs for minutes before a line is printed."""


@dataclass
class ReproduceConfig:
    name: str = "cpu_mini"
    """The preset's name (``reproduce=<name>``); the run directory is ``outputs/reproduce/<run_name>``."""
    stages: list[str] | None = None
    """A subset to run (their inputs must be finished already); null: every stage not yet finished."""
    pretrain_tokens: int = 400_000
    """D of the pretraining budget C = M D: the fitted laws give its batch size and lr."""
    seq_len: int = 128
    batch_range: list[int] | None = None
    """A clamp of the fitted global batch (sequences); null (every preset but the smoke test's): the
    fit's batch as it is, rounded to whole micro-batches. The smoke test's few-step sweep fits
    nothing worth extrapolating, so it pins its batch here."""
    lr_range: list[float] | None = None
    """A clamp of the fitted peak learning rate; null: the fit's."""
    micro_batch_size: int = 8
    ramp_fraction: float = 0.25
    """Share of the pretraining tokens under the batch ramp (DeepSeek-V3: 469B of 14.8T, 3%)."""
    ramp_start_fraction: float = 0.25
    """The ramp starts at this share of the batch (V3: 3072 of 15360, 20%)."""
    passkey_lengths: list[int] = field(default_factory=lambda: [128, 256, 512])
    eval_limit: int | None = None
    """Documents per lm-eval task (null: all)."""
    device: str = "cpu"
    """cpu or cuda: where every stage trains, samples and evaluates."""
    data_build: str | None = None
    """A finished data build (a directory with ``tokenizer/`` and ``shards/``: a pipeline run's
    output, or a data cache such as ``$DSL_LIT_CACHE_ROOT/bundled_corpus_v8192`` that any recipe
    builds on first use) that the stages read instead of the data stage running the pipeline, which
    needs ``datasets``; the scaling sweep reads it too (its own 2048-token build needs the
    pipeline). Null: the data stage runs the pipeline."""
    seed: int | None = None
    """The seed of every training stage (``trainer.seed``; the ablations use it and the next
    ``ablation_seeds - 1``); null: the recipes' own (1234). A second run with another seed checks
    that the verdicts do not hang on one draw."""
    ablation_seeds: int = 3
    """Seeds per ablation variant (with / without MTP, without the bias update): effects smaller than
    their spread over seeds are reported as such, not as a verdict."""
    ablation_fraction: float = 1.0
    """Share of the pretraining's steps each ablation run trains (the same lr and batch schedule)."""
    concurrent_runs: int = 1
    """Runs of one stage at a time (the ablations' seeds), each on cores / this many threads: two
    single-thread runs of a tiny model finish in about the time of one two-thread run."""
    overrides: dict[str, list[str]] = field(default_factory=dict)
    """Hydra overrides per stage, e.g. ``{pretrain: [trainer.max_steps=100]}``, applied after the
    wiring (init_from, data dirs, fitted lr and batch), so a preset can change anything."""
    estimates_s: dict[str, float] = field(default_factory=dict)
    """Measured seconds per stage, for the progress line's estimate of the time left."""

    def validate(self) -> ReproduceConfig:
        for key, names in (("stages", self.stages or []), ("overrides", self.overrides),
                           ("estimates_s", self.estimates_s)):
            unknown = [n for n in names if n not in STAGES]
            if unknown:
                raise ConfigError(f"reproduce.{key} names an unknown stage {unknown[0]!r}; stages are {list(STAGES)}")
        if self.stages is not None and not self.stages:
            raise ConfigError("reproduce.stages=[] runs nothing; name stages or use null for all")
        for stage, values in self.overrides.items():
            if not isinstance(values, list) or not all(isinstance(v, str) and "=" in v for v in values):
                raise ConfigError(f"reproduce.overrides.{stage} must be a list of Hydra overrides key=value, got {values!r}")
        for key in ("seq_len", "micro_batch_size", "pretrain_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"reproduce.{key}={value!r} must be a positive integer")
        if self.pretrain_tokens > MAX_PRETRAIN_TOKENS:
            raise ConfigError(f"reproduce.pretrain_tokens={self.pretrain_tokens} is over {MAX_PRETRAIN_TOKENS:.0e}: "
                              "make reproduce is DeepSeek in miniature; train at scale with recipes/pretrain.py")
        if self.pretrain_tokens < self.seq_len:
            raise ConfigError(f"reproduce.pretrain_tokens={self.pretrain_tokens} is less than one sequence "
                              f"(reproduce.seq_len={self.seq_len})")
        if self.batch_range is not None:
            low, high = self._range("batch_range", self.batch_range)
            if low < self.micro_batch_size or low % self.micro_batch_size or high % self.micro_batch_size:
                raise ConfigError(f"reproduce.batch_range={self.batch_range} must be multiples of "
                                  f"reproduce.micro_batch_size={self.micro_batch_size}")
        if self.lr_range is not None and self._range("lr_range", self.lr_range)[0] <= 0:
            raise ConfigError(f"reproduce.lr_range={self.lr_range} must be positive")
        for key in ("ramp_fraction", "ramp_start_fraction"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"reproduce.{key}={getattr(self, key)} must be in [0, 1)")
        for key in ("ablation_seeds", "concurrent_runs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"reproduce.{key}={value!r} must be a positive integer")
        if not 0.0 < self.ablation_fraction <= 1.0:
            raise ConfigError(f"reproduce.ablation_fraction={self.ablation_fraction} must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ConfigError(f"reproduce.seed={self.seed!r} must be a non-negative integer or null")
        missing = [n for n in CONTEXT_LENGTHS if n not in (self.passkey_lengths or [])]
        if missing:
            raise ConfigError(f"reproduce.passkey_lengths={self.passkey_lengths} must include {missing[0]}: the claim "
                              f"scores the context base and its YaRN extension at their trained lengths {list(CONTEXT_LENGTHS)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"reproduce.device={self.device!r} must be cpu or cuda")
        if self.data_build is not None and not str(self.data_build).strip():
            raise ConfigError("reproduce.data_build='' names no directory; use null to run the data pipeline")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise ConfigError(f"reproduce.eval_limit={self.eval_limit} must be >= 1 or null")
        return self

    @property
    def accelerator(self) -> str:
        """Lightning's name for :attr:`device` (``trainer.accelerator``)."""
        return "gpu" if self.device == "cuda" else "cpu"

    @staticmethod
    def _range(key: str, values: list) -> tuple:
        if len(values) != 2 or values[0] > values[1]:
            raise ConfigError(f"reproduce.{key}={values} must be [low, high] with low <= high")
        return values[0], values[1]
