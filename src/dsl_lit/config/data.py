"""Config of the pretraining data path, validated at start-up before any process group exists."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsl_lit.config.errors import ConfigError
from dsl_lit.config.schema import dataclass_from_dict


@dataclass
class DataConfig:
    """Where the corpus and the built artefacts live, and how batches are cut.

    ``global_batch_size`` counts sequences per optimizer step over all data-parallel ranks, so the
    training recipe (and its learning-rate schedule) does not change with the layout.
    """

    corpus_dir: str  # a directory of *.jsonl.gz documents (the bundled corpus: data/corpus)
    cache_dir: str  # the tokenizer and the packed shards are built here, once per corpus content
    tokenizer_vocab_size: int = 8192
    tokenizer_max_bytes: int | None = None
    tokenizer_dir: str | None = None
    """A ready tokenizer directory (a model's release: tokenizer.json + tokenizer_config.json) the
    corpus is packed with instead of training one (``tokenizer_vocab_size``/``max_bytes`` unused)."""
    seq_len: int = 256
    global_batch_size: int = 32
    micro_batch_size: int = 8
    num_workers: int = 0
    seed: int = 1234
    val_windows: int = 0
    """Windows at the end of the packed stream held out for validation (never trained on),
    validated in whole global batches (``val_windows // global_batch_size`` of them)."""

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
        return self
