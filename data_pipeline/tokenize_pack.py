"""Pipeline stage: tokenize a document dataset and pack it into shards of ``dsl_lit.data.format``.

Why two steps: ``datasets.map`` tokenizes in parallel and caches the result under a fingerprint
derived from the tokenizer file and text field, so a rerun with the same inputs skips the work;
the writer then streams the token lists in document order, so the shards are byte-identical for
the same input whatever ``num_proc`` is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
from tokenizers import Tokenizer

from data_pipeline.packed_writer import PackedShardWriter
from dsl_lit.data.format import META_FILE, TOKENIZER_FILE, file_sha256

log = logging.getLogger(__name__)


class _Encode:
    """Picklable batch tokenizer for ``datasets.map`` workers; loads the tokenizer once per process."""

    def __init__(self, tokenizer_file: str, text_field: str, single_threaded: bool) -> None:
        self.tokenizer_file = tokenizer_file
        self.text_field = text_field
        self.single_threaded = single_threaded
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        if self._tokenizer is None:
            if self.single_threaded:  # in a worker process: never start a Rust thread pool there
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
            self._tokenizer = Tokenizer.from_file(self.tokenizer_file)
        texts = batch[self.text_field]
        # add_special_tokens=False: packing adds EOS itself; no BOS is prepended in pretraining.
        encodings = self._tokenizer.encode_batch([t or "" for t in texts], add_special_tokens=False)
        return {"input_ids": [e.ids for e in encodings]}


@contextlib.contextmanager
def _tokenizers_parallelism(enabled: bool) -> Iterator[None]:
    """Forked workers that inherit a started Rust thread pool can deadlock: disable it around a
    multi-process map, then restore the caller's setting."""
    key = "TOKENIZERS_PARALLELISM"
    saved = os.environ.get(key)
    if not enabled:
        os.environ[key] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def _tokenize(
    dataset: datasets.Dataset, tokenizer_file: str, sha: str, text_field: str, num_proc: int, batch_size: int
) -> datasets.Dataset:
    return dataset.map(
        _Encode(tokenizer_file, text_field, single_threaded=num_proc > 1),
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=dataset.column_names,
        # The function pickles to file paths, which say nothing about the tokenizer's contents:
        # fingerprint on what determines the output instead (num_proc does not).
        new_fingerprint=hashlib.sha256(
            f"{dataset._fingerprint}|{sha}|{text_field}|tokenize_pack-v1".encode()
        ).hexdigest()[:32],
        desc="tokenize",
    )


def tokenize_pack(
    dataset: datasets.Dataset,
    tokenizer_dir: Path,
    output_dir: Path,
    text_field: str = "text",
    shard_tokens: int = 2**24,
    num_proc: int = 1,
    batch_size: int = 1000,
) -> Path:
    """Tokenize ``dataset[text_field]`` and write packed shards (EOS after each document) to ``output_dir``.

    Empty documents are skipped and counted in meta.json as ``num_empty_skipped``. Returns ``output_dir``.
    """
    tokenizer_dir = Path(tokenizer_dir)
    tokenizer_file = tokenizer_dir / TOKENIZER_FILE
    tok_meta = json.loads((tokenizer_dir / META_FILE).read_text(encoding="utf-8"))
    sha = file_sha256(tokenizer_file)
    if text_field not in dataset.column_names:
        raise ValueError(f"text_field {text_field!r} not in dataset columns {dataset.column_names}")

    start = time.perf_counter()
    with _tokenizers_parallelism(num_proc <= 1):
        tokenized = _tokenize(dataset, str(tokenizer_file), sha, text_field, num_proc, batch_size)
    tokenized = tokenized.with_format("numpy")
    with PackedShardWriter(
        output_dir,
        eos_id=int(tok_meta["eos_id"]),
        vocab_size=int(tok_meta["vocab_size"]),
        padded_vocab_size=int(tok_meta["padded_vocab_size"]),
        shard_tokens=shard_tokens,
        tokenizer_sha256=sha,
    ) as writer:
        for i in range(0, len(tokenized), batch_size):
            for ids in tokenized[i : i + batch_size]["input_ids"]:
                writer.add_document(ids)
        writer.close({"text_field": text_field})
    log.info(
        "packed %d documents, %d tokens (%d empty skipped) into %s in %.1fs",
        writer.num_documents,
        writer.num_tokens,
        writer.num_empty_skipped,
        output_dir,
        time.perf_counter() - start,
    )
    return Path(output_dir)
