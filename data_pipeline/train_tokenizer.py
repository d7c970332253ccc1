"""Train a DeepSeek-style byte-level BPE tokenizer with Hugging Face ``tokenizers``.

Why this shape: DeepSeek LLM's released tokenizer pre-splits newlines, letter runs (with one leading
space), punctuation runs, trailing whitespace, CJK/Hangul runs and single digits, then runs
byte-level BPE, so any byte sequence round-trips and numbers never merge into multi-digit tokens.
The output directory loads with ``transformers.AutoTokenizer.from_pretrained`` (no transformers
import is needed here) and carries ``meta.json`` with the ids and the padded embedding size the
model needs. Stage ``train_tokenizer`` (settings: the ``tokenizer`` section) trains it on a run's
``kept/`` documents into ``output_dir/tokenizer``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from data_pipeline.shard_io import building_dir, shard_file
from data_pipeline.stage import Stage, Step
from dsl_lit.config.errors import ConfigError
from dsl_lit.data.format import DEEPSEEK_SPECIAL_TOKENS, META_FILE, TOKENIZER_DIR, TOKENIZER_FILE

log = logging.getLogger(__name__)

# Horizontal whitespace: a leading space may join a word, but a newline never does.
_HSPACE = r"[^\S\r\n]"
_CJK = r"\p{Han}\p{Hangul}\p{Hiragana}\p{Katakana}"
# Alternatives are tried left to right at each position, so newlines always stand alone.
PRETOKENIZE_PATTERN = "|".join(
    [
        r"[\r\n]",  # each line break on its own
        rf"{_HSPACE}?[\p{{L}}\p{{M}}&&[^{_CJK}]]+",  # a word (Latin, Greek, Cyrillic, ...) + one space
        rf"{_HSPACE}?[\p{{P}}\p{{S}}]+",  # a run of punctuation / symbols + one space
        rf"{_HSPACE}+$",  # whitespace at the end of a line
        rf"[{_CJK}]+",  # runs of CJK ideographs, kana and Hangul
        r"\p{N}+",  # numbers (split into single digits by the Digits step)
    ]
)

EMBEDDING_MULTIPLE = 128


def build_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Regex split, then single digits, then bytes mapped to printable characters."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def padded_vocab_size(vocab_size: int, multiple: int = EMBEDDING_MULTIPLE) -> int:
    """Embedding rows: the vocab rounded up to a multiple of 128 so matmuls and TP shards stay aligned.

    (DeepSeek LLM padded its 100015 tokens further, to 102400; a preset can still ask for that.)
    """
    return -(-vocab_size // multiple) * multiple


def sample_texts(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Yield a deterministic sample of about ``max_bytes`` UTF-8 bytes, or everything when ``None``.

    Keeps the documents with the smallest content hashes that fit in the budget together (the
    longest prefix in hash order): independent of input order and of the machine, uniform over
    documents, and memory bounded by ``max_bytes``.
    """
    if max_bytes is None:
        yield from texts
        return
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    heap: list[tuple[int, str]] = []  # max-heap on the hash (stored negated)
    cutoff: int | None = None  # every hash >= cutoff is out, whenever it arrives
    total = 0
    for text in texts:
        key = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")
        if cutoff is not None and key >= cutoff:
            continue
        heapq.heappush(heap, (-key, text))
        total += len(text.encode("utf-8"))
        while total > max_bytes and heap:
            cutoff = -heap[0][0]
            while heap and -heap[0][0] == cutoff:  # equal hashes (duplicate texts) leave together
                total -= len(heapq.heappop(heap)[1].encode("utf-8"))
    if not heap:
        raise ValueError(f"max_bytes={max_bytes} is smaller than any single document; raise it")
    for _, text in sorted(heap, reverse=True):  # ascending hash order
        yield text


def _hf_configs(special_tokens: list[str]) -> tuple[dict, dict]:
    """tokenizer_config.json and special_tokens_map.json for transformers (4.x and 5.x)."""
    named = {"bos_token": special_tokens[0], "eos_token": special_tokens[1], "pad_token": special_tokens[2]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "add_bos_token": False,
        "add_eos_token": False,
        # Spaces are data in byte-level BPE: never "clean" them, or decode(encode(x)) != x.
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": special_tokens[3:],
    }
    return config, {**named, "additional_special_tokens": special_tokens[3:]}


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    output_dir: Path,
    special_tokens: list[str] = DEEPSEEK_SPECIAL_TOKENS,
    max_bytes: int | None = None,
    embedding_size: int | None = None,
) -> Path:
    """Train BBPE on ``texts`` and write a loadable tokenizer directory; returns ``output_dir``.

    ``vocab_size`` includes the special tokens (the first three are used as bos, eos and pad).
    ``embedding_size`` is the model's embedding rows written to meta.json as ``padded_vocab_size``
    (DeepSeek LLM: 102400 for 100015 tokens); ``None`` rounds the vocab up to a multiple of 128. The
    directory appears atomically: it is built under a temporary name and renamed when complete.
    """
    if len(special_tokens) < 3:
        raise ValueError("special_tokens must start with bos, eos and pad")
    if embedding_size is not None and embedding_size < vocab_size:
        raise ValueError(f"embedding_size={embedding_size} is below vocab_size={vocab_size}")
    min_vocab = 256 + len(special_tokens)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet + specials ({min_vocab})")
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = build_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sample_texts(texts, max_bytes), trainer=trainer)

    ids = [tokenizer.token_to_id(t) for t in special_tokens[:3]]
    meta = {
        "vocab_size": tokenizer.get_vocab_size(),
        "padded_vocab_size": embedding_size or padded_vocab_size(tokenizer.get_vocab_size()),
        "bos_id": ids[0],
        "eos_id": ids[1],
        "pad_id": ids[2],
        "requested_vocab_size": vocab_size,
        "max_bytes": max_bytes,
    }
    if meta["vocab_size"] < vocab_size:
        log.warning("corpus too small: trained %d of %d requested tokens", meta["vocab_size"], vocab_size)
    config, special_map = _hf_configs(list(special_tokens))

    with building_dir(output_dir) as tmp_dir:
        tokenizer.save(str(tmp_dir / TOKENIZER_FILE))
        for name, obj in (
            ("tokenizer_config.json", config),
            ("special_tokens_map.json", special_map),
            (META_FILE, meta),  # last: its presence marks a complete directory
        ):
            (tmp_dir / name).write_text(
                json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
    log.info(
        "tokenizer: %d tokens (embedding %d) -> %s", meta["vocab_size"], meta["padded_vocab_size"], output_dir
    )
    return output_dir


@dataclass
class TokenizerConfig:
    vocab_size: int = 100_015  # including the special tokens (DeepSeek LLM: 100000 + 15)
    padded_vocab_size: int | None = 102_400  # embedding rows; null: rounded up to a multiple of 128
    special_tokens: list[str] | None = None  # null: DeepSeek LLM's 15 (bos, eos, pad first)
    max_bytes: int | None = 1_000_000_000  # training sample (memory grows with distinct pre-tokens)

    def validate(self) -> TokenizerConfig:
        specials = 15 if self.special_tokens is None else len(self.special_tokens)
        if self.special_tokens is not None and len(self.special_tokens) < 3:
            raise ConfigError("tokenizer.special_tokens must start with bos, eos and pad (at least 3)")
        if self.vocab_size < 256 + specials:
            raise ConfigError(
                f"tokenizer.vocab_size={self.vocab_size} must be at least 256 bytes + {specials} specials"
            )
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ConfigError(
                f"tokenizer.padded_vocab_size={self.padded_vocab_size} is below tokenizer.vocab_size={self.vocab_size}"
            )
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(
                f"tokenizer.max_bytes={self.max_bytes} must be positive, or null for everything"
            )
        return self


def _kept_texts(kept_dir: Path, num_shards: int, counter: list[int]) -> Iterator[str]:
    for s in range(num_shards):
        for batch in pq.ParquetFile(kept_dir / shard_file(s)).iter_batches(batch_size=1000, columns=["text"]):
            for text in batch.column(0).to_pylist():
                counter[0] += len(text.encode("utf-8"))
                yield text


def train_unit(ctx: Any, unit: int) -> dict[str, Any]:
    cfg: TokenizerConfig = ctx.config
    counter = [0]
    start = time.perf_counter()
    out = train_tokenizer(
        _kept_texts(ctx.output_dir / "kept", ctx.num_shards, counter),
        cfg.vocab_size,
        ctx.output_dir / TOKENIZER_DIR,
        special_tokens=cfg.special_tokens or DEEPSEEK_SPECIAL_TOKENS,
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
    after_finalize = True

    def steps(self) -> list[Step]:
        return [self.step(train_unit, units=1)]
