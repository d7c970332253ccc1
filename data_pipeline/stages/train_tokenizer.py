"""Stage ``train_tokenizer``: trains the run's tokenizer on ``kept/`` into ``output_dir/tokenizer``.

The training itself is ``data_pipeline/tokenizer/training.py``; this file holds the ``tokenizer``
section's settings (``tokenize_pack`` reads them too) and the one unit. ``tokenizer.path`` names a
ready tokenizer instead (no training).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from data_contract.errors import ConfigError
from data_contract.format import META_FILE, TOKENIZER_DIR
from data_contract.tokenizer_dir import validate_tokenizer_dir
from data_pipeline.context import Context
from data_pipeline.io.shards import shard_file
from data_pipeline.stage import Phase, Stage, Step
from data_pipeline.tokenizer.spec import BUNDLED, SPEC_NAMES
from data_pipeline.tokenizer.training import tokenizer_spec, train_tokenizer


@dataclass
class TokenizerConfig:
    spec: str = BUNDLED  # bundled | deepseek_llm | deepseek_v3 (conf/data_pipeline/tokenizer/<preset>.yaml)
    vocab_size: int = 100_015  # BPE tokens to learn, including the spec's in-vocabulary added tokens
    padded_vocab_size: int | None = 102_400  # embedding rows; null: rounded up to a multiple of 128
    special_tokens: list[str] | None = None  # spec=bundled only; null: DeepSeek's 15 (bos, eos, pad first)
    max_bytes: int | None = 1_000_000_000  # training sample (memory grows with distinct pre-tokens)
    path: str | None = None
    """A ready tokenizer directory (a model's release, or an earlier run's ``tokenizer/``): packing
    uses it as it is and copies it to ``output_dir/tokenizer``; nothing is trained."""

    def validate(self) -> TokenizerConfig:
        if self.spec not in SPEC_NAMES:
            raise ConfigError(f"tokenizer.spec={self.spec!r} is not one of {list(SPEC_NAMES)}")
        if self.special_tokens is not None and self.spec != BUNDLED:
            raise ConfigError(f"tokenizer.special_tokens applies to tokenizer.spec=bundled only: {self.spec} "
                              "carries the released added tokens; set tokenizer.special_tokens=null")
        if self.special_tokens is not None and len(self.special_tokens) < 3:
            raise ConfigError("tokenizer.special_tokens must start with bos, eos and pad (at least 3)")
        spec = tokenizer_spec(self.spec, self.special_tokens)
        specials = len(spec.in_vocab_tokens)
        if self.vocab_size < 256 + specials:
            raise ConfigError(
                f"tokenizer.vocab_size={self.vocab_size} must be at least 256 bytes + {specials} specials"
            )
        if spec.bpe_vocab_size is not None and self.vocab_size > spec.bpe_vocab_size:
            raise ConfigError(f"tokenizer.vocab_size={self.vocab_size} is above {spec.name}'s BPE vocabulary "
                              f"({spec.bpe_vocab_size}), where its added tokens take their released ids")
        total = max(self.vocab_size, spec.bpe_vocab_size or 0, *(t["id"] + 1 for t in spec.added_tokens))
        if self.padded_vocab_size is not None and self.padded_vocab_size < total:
            raise ConfigError(
                f"tokenizer.padded_vocab_size={self.padded_vocab_size} is below the {total} tokens of "
                f"tokenizer.spec={self.spec} with tokenizer.vocab_size={self.vocab_size}"
            )
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(
                f"tokenizer.max_bytes={self.max_bytes} must be positive, or null for everything"
            )
        if self.path is not None:  # every file it holds, before any stage runs
            validate_tokenizer_dir(self.path, "tokenizer.path")
        return self


def _kept_texts(kept_dir: Path, num_shards: int, counter: list[int]) -> Iterator[str]:
    for s in range(num_shards):
        for batch in pq.ParquetFile(kept_dir / shard_file(s)).iter_batches(batch_size=1000, columns=["text"]):
            for text in batch.column(0).to_pylist():
                counter[0] += len(text.encode("utf-8"))
                yield text


def train_unit(ctx: Context, unit: int) -> dict[str, Any]:
    cfg: TokenizerConfig = ctx.config
    counter = [0]
    start = time.perf_counter()
    out = train_tokenizer(
        _kept_texts(ctx.output_dir / "kept", ctx.num_shards, counter),
        cfg.vocab_size,
        ctx.output_dir / TOKENIZER_DIR,
        spec=tokenizer_spec(cfg.spec, cfg.special_tokens),
        max_bytes=cfg.max_bytes,
        embedding_size=cfg.padded_vocab_size,
    )
    seconds = time.perf_counter() - start
    meta = json.loads((out / META_FILE).read_text())
    return {
        **meta,
        "bytes_read": counter[0],
        "train_mb_per_s": round(counter[0] / 1e6 / max(seconds, 1e-9), 3),
    }


class TrainTokenizer(Stage):
    """Runs after finalize, on ``kept/``: writes ``output_dir/tokenizer``."""

    name = "train_tokenizer"
    Config = TokenizerConfig
    section = "tokenizer"
    phase = Phase.PUBLISHED

    def steps(self) -> list[Step]:
        if self.config.path is not None:
            raise ConfigError(f"tokenizer.path={self.config.path} is a ready tokenizer: drop train_tokenizer "
                              "from stages (tokenize_pack packs with it as it is)")
        return [self.step(train_unit, units=1)]
