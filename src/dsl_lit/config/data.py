"""Config of the pretraining data path, validated at start-up before any process group exists."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict


@dataclass
class BatchRampConfig:
    """``data.batch_ramp``: the global batch grows from ``start`` sequences to
    ``data.global_batch_size`` in steps of ``increment`` over the first ``tokens`` training tokens
    (DeepSeek-V3: 3072 -> 15360 over 469B; Megatron's ``--rampup-batch-size``). The schedule is a
    function of the samples consumed only, so every layout (and a resume under another one) sees
    the same batches. ``start: null`` disables it."""

    start: int | None = None
    tokens: int = 0
    increment: int | None = None
    """Sequences added per stage (null: ``start``); ``start`` and it must be multiples of
    data.micro_batch_size x the data-parallel size."""

    @property
    def enabled(self) -> bool:
        return self.start is not None and self.tokens > 0


@dataclass
class BatchSchedule:
    """The global batch size of every step: constant, or ramped (:class:`BatchRampConfig`)."""

    global_batch_size: int
    seq_len: int
    ramp: BatchRampConfig

    @property
    def _stages(self) -> int:
        return (self.global_batch_size - self.ramp.start) // self._increment if self.ramp.enabled else 0

    @property
    def _increment(self) -> int:
        return self.ramp.increment or self.ramp.start

    @property
    def ramp_samples(self) -> int:
        return -(-self.ramp.tokens // self.seq_len) if self.ramp.enabled else 0

    def size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples."""
        if not self.ramp.enabled or consumed_samples >= self.ramp_samples:
            return self.global_batch_size
        stage = consumed_samples * (self._stages + 1) // self.ramp_samples
        return min(self.global_batch_size, self.ramp.start + stage * self._increment)

    def advance(self, consumed_samples: int, steps: int) -> int:
        """Samples consumed after ``steps`` more steps (whole stages at a time: O(stages))."""
        consumed = consumed_samples
        while steps > 0:
            size = self.size_at(consumed)
            if size == self.global_batch_size:
                return consumed + steps * size
            stage = consumed * (self._stages + 1) // self.ramp_samples
            stage_end = -(-(stage + 1) * self.ramp_samples // (self._stages + 1))  # first sample of the next stage
            in_stage = max(1, -(-(stage_end - consumed) // size))
            take = min(steps, in_stage)
            consumed, steps = consumed + take * size, steps - take
        return consumed

    def validate(self, quantum: int) -> None:
        """ConfigError unless every batch of the ramp splits into ``quantum`` = micro x dp pieces."""
        ramp = self.ramp
        if ramp.start is None and ramp.tokens == 0:
            return
        if ramp.start is None or ramp.tokens <= 0:
            raise ConfigError("data.batch_ramp needs both start (sequences) and tokens (> 0), or start=null")
        if not 0 < ramp.start <= self.global_batch_size:
            raise ConfigError(f"data.batch_ramp.start={ramp.start} must be in (0, data.global_batch_size="
                              f"{self.global_batch_size}]")
        increment = self._increment
        if increment <= 0 or (self.global_batch_size - ramp.start) % increment:
            raise ConfigError(f"data.batch_ramp.increment={increment} must divide data.global_batch_size - "
                              f"data.batch_ramp.start = {self.global_batch_size - ramp.start}")
        for name, value in (("start", ramp.start), ("increment", increment)):
            if value % quantum:
                raise ConfigError(f"data.batch_ramp.{name}={value} must be a multiple of data.micro_batch_size x "
                                  f"the data-parallel size = {quantum} (every ramp step splits into micro-batches)")


@dataclass
class DataConfig:
    """Where the corpus and the built artefacts live, and how batches are cut.

    ``global_batch_size`` counts sequences per optimizer step over all data-parallel ranks, so the
    training recipe (and its learning-rate schedule) does not change with the layout.
    """

    corpus_dir: str  # a directory of *.jsonl.gz documents (the bundled corpus: data/corpus)
    cache_dir: str  # the tokenizer and the packed shards are built here, once per corpus content
    tokenizer_vocab_size: int = 8192
    """Vocabulary of the byte-level BPE tokenizer trained on the corpus (special tokens included)."""
    tokenizer_max_bytes: int | None = None
    """Train the tokenizer on at most this many bytes of the corpus (null: all of it)."""
    tokenizer_dir: str | None = None
    """A ready tokenizer directory (a model's release: tokenizer.json + tokenizer_config.json) the
    corpus is packed with instead of training one (``tokenizer_vocab_size``/``max_bytes`` unused)."""
    seq_len: int = 256
    """Tokens per training sequence: the packed stream is cut into windows of this length."""
    global_batch_size: int = 32
    """Sequences per optimizer step, summed over every data-parallel rank and micro-batch."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass on one rank; the step accumulates gradients over
    ``global_batch_size / (micro_batch_size x data-parallel size)`` of them."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: batches are read in the training process)."""
    seed: int = 1234
    """Seed of the order in which the packed windows are drawn (and of the FIM choices)."""
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)
    decontaminate: bool = True
    """Before tokenizing, drop corpus documents sharing a word 13-gram with the bundled evaluation
    tasks (data/eval_tasks; the data pipeline's ``decontaminate`` stage), so evaluating a model on
    them does not measure memorisation."""
    fim_rate: float = 0.0
    """Share of documents packed as fill-in-the-middle (DeepSeek-V3: 0.1), Prefix-Suffix-Middle with
    the tokenizer's FIM tokens, drawn per document from ``seed`` when the shards are built."""
    fim_spm_rate: float = 0.0
    """Share of the FIM documents in the Suffix-Prefix-Middle order instead."""
    val_windows: int = 0
    """Windows at the end of the packed stream held out for validation (never trained on),
    validated in whole batches of ``val_batch_size`` (``val_windows // val_batch_size`` of them)."""
    val_batch_size: int | None = None
    """Windows per validation batch; null: ``global_batch_size``. Validation keeps no activations
    for a backward pass, so a run training one sequence a step (a scaling sweep's smallest batch)
    need not validate one at a time: the held-out loss is the same mean over the same windows."""

    @property
    def validation_batch(self) -> int:
        return self.val_batch_size or self.global_batch_size

    @classmethod
    def coerce(cls, cfg: DataConfig | Mapping[str, Any]) -> DataConfig:
        """Accept a ``DataConfig`` or a mapping (a Hydra ``DictConfig`` node, resolved on access)."""
        if isinstance(cfg, cls):
            return cfg
        values = {str(k): cfg[k] for k in cfg}
        missing = sorted(k for k in ("corpus_dir", "cache_dir") if k not in values)
        if missing:
            raise ConfigError(f"missing data field(s) {', '.join('data.' + m for m in missing)}")
        return dataclass_from_dict(cls, values, "data")

    def validate(self, dp_size: int = 1) -> DataConfig:
        """Raise ``ConfigError`` naming the first bad field and how to fix it; return self."""
        for name in ("tokenizer_vocab_size", "seq_len", "global_batch_size", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"data.{name}={value!r} must be a positive integer")
        if self.tokenizer_vocab_size < 256 + 15:
            raise ConfigError(
                f"data.tokenizer_vocab_size={self.tokenizer_vocab_size} is too small: byte-level BPE needs "
                "256 byte tokens + 15 special tokens; use at least 271 (512 is a sensible minimum)"
            )
        if self.tokenizer_max_bytes is not None and self.tokenizer_max_bytes <= 0:
            raise ConfigError(
                f"data.tokenizer_max_bytes={self.tokenizer_max_bytes} must be positive, or null for the whole corpus"
            )
        if self.val_windows < 0:
            raise ConfigError(f"data.val_windows={self.val_windows} must be >= 0 (0: no held-out data)")
        if self.val_batch_size is not None and (self.val_batch_size <= 0 or self.val_batch_size % dp_size):
            raise ConfigError(f"data.val_batch_size={self.val_batch_size} must be a positive multiple of the "
                              f"data-parallel size {dp_size} (each rank validates its share), or null")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers={self.num_workers} must be >= 0")
        if dp_size <= 0:
            raise ConfigError(f"data-parallel size {dp_size} must be positive")
        step = self.micro_batch_size * dp_size
        if self.global_batch_size % step:
            raise ConfigError(
                f"data.global_batch_size={self.global_batch_size} must be a multiple of "
                f"data.micro_batch_size={self.micro_batch_size} x data-parallel size {dp_size} = {step}: "
                f"e.g. data.global_batch_size={max(step, self.global_batch_size // step * step)}"
            )
        if not self.corpus_dir:
            raise ConfigError("data.corpus_dir is empty: point it at a directory of *.jsonl.gz documents")
        if not Path(self.corpus_dir).is_dir():
            raise ConfigError(
                f"data.corpus_dir={self.corpus_dir} is not a directory: point it at a directory of documents "
                "(*.jsonl.gz, *.jsonl, *.parquet, *.txt; the bundled corpus is data/corpus)"
            )
        if not self.cache_dir:
            raise ConfigError("data.cache_dir is empty: give a directory for the tokenizer and shards")
        if self.tokenizer_dir and not (Path(self.tokenizer_dir) / "tokenizer.json").is_file():
            raise ConfigError(f"data.tokenizer_dir={self.tokenizer_dir} has no tokenizer.json: point it at a "
                              "tokenizer directory (a model's Hugging Face directory), or null to train one")
        self.batch_schedule.validate(step)
        for name in ("fim_rate", "fim_spm_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"data.{name}={getattr(self, name)} must lie in [0, 1]")
        if self.fim_rate and self.tokenizer_dir:
            self._check_fim_tokens(Path(self.tokenizer_dir) / "tokenizer.json")
        return self

    def _check_fim_tokens(self, tokenizer_json: Path) -> None:
        """The tokenizer's added tokens hold DeepSeek's three fill-in-the-middle tokens."""
        added = {t.get("content") for t in json.loads(tokenizer_json.read_text(encoding="utf-8")).get("added_tokens", [])}
        missing = [t for t in ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>") if t not in added]
        if missing:
            raise ConfigError(f"data.fim_rate={self.fim_rate} needs fill-in-the-middle tokens, but the tokenizer in "
                              f"data.tokenizer_dir={self.tokenizer_dir} lacks {missing}; use one with them or set "
                              "data.fim_rate=0")

    @property
    def batch_schedule(self) -> BatchSchedule:
        return BatchSchedule(self.global_batch_size, self.seq_len, self.batch_ramp)

    @property
    def smallest_global_batch(self) -> int:
        return self.batch_ramp.start if self.batch_ramp.enabled else self.global_batch_size
