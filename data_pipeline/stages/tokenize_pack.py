"""Stage ``tokenize_pack``: tokenize documents and pack them into shards of ``data_contract.format``.

Why batches of flat arrays: the Rust tokenizer encodes a batch of documents on its own threads
(``encode_batch``, which releases the GIL) while this process turns the previous batch's token lists
into one flat array with their lengths and the writer appends EOS and rolls shards with numpy, so
the Rust threads rarely wait for Python and nothing is done per document beyond reading its ids.
``num_proc > 1`` tokenizes in that many forked processes instead (``datasets.map``, one Rust thread
each). Documents are written in order either way, so the shards are byte-identical for the same
input whatever ``num_proc`` or ``batch_size`` is.

Why per kept shard and then a merge: tokenizing is the expensive part and parallelises over the
kept shards (each packed on its own, resumable); the merge only links the shard files into one
packed dataset, renumbered in shard order, with one meta.json written last.
The tokenizer is the run's own (``train_tokenizer``) or a ready one (``tokenizer.path``: a model's
release, read by ``data_contract.tokenizer_dir``), which the merge copies to ``output_dir/tokenizer``
with a meta.json, so the output has the layout the data module reads either way.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
from tokenizers import Tokenizer

from data_contract.errors import ConfigError
from data_contract.format import (
    META_FILE,
    SHARDS_DIR,
    TOKENIZER_DIR,
    TOKENIZER_FILE,
    file_sha256,
    index_name,
    shard_name,
)
from data_contract.tokenizer_dir import TOKENIZER_FILES, read_tokenizer_meta
from data_pipeline.context import Context
from data_pipeline.io.packed_writer import PackedShardWriter
from data_pipeline.io.shards import building_dir, link_or_copy, read_documents, shard_file, table_of
from data_pipeline.stage import Phase, Stage, Step
from data_pipeline.tokenizer.fim import encode_documents, fim_token_ids, plan_document

log = logging.getLogger(__name__)


class _Encode:
    """Picklable batch tokenizer for ``datasets.map`` workers; loads the tokenizer once per process."""

    def __init__(self, tokenizer_file: str, text_field: str, single_threaded: bool, fim: FIMSettings | None = None,
                 shard: int = 0) -> None:
        self.tokenizer_file = tokenizer_file
        self.text_field = text_field
        self.single_threaded = single_threaded
        self.fim, self.shard = fim, shard
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    def __call__(self, batch: dict[str, list[Any]], rows: list[int]) -> dict[str, list[list[int]]]:
        return {"input_ids": self.encode(batch[self.text_field], rows)}

    def encode(self, texts: list[str | None], rows: list[int] | range) -> list[list[int]]:
        """Token ids of ``texts`` (dataset rows ``rows``: FIM draws per row)."""
        if self._tokenizer is None:
            if self.single_threaded:  # in a worker process: never start a Rust thread pool there
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
            self._tokenizer = Tokenizer.from_file(self.tokenizer_file)
        texts = [t or "" for t in texts]
        # add_special_tokens=False: packing adds EOS itself; no BOS is prepended in pretraining.
        fim = self.fim
        if fim is None or fim.rate <= 0:
            return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]
        plans = [plan_document(t, fim.rate, fim.spm_rate, fim.seed, self.shard, r) for t, r in zip(texts, rows)]
        return encode_documents(self._tokenizer, texts, plans, fim_token_ids(self._tokenizer))


def _flat(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(all token ids in one array, each document's length)."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())), lengths


def _threaded_batches(dataset: datasets.Dataset, encoder: _Encode, batch_size: int, in_flight: int = 2
                      ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Flat token batches in document order. ``in_flight`` batches encode at once (the GIL released),
    so the Rust threads have the next batch's documents to start on while the last documents of
    one batch finish, and while the caller writes."""
    column = table_of(dataset).column(encoder.text_field)

    def encode(start: int) -> list[list[int]]:
        texts = column.slice(start, batch_size).to_pylist()
        return encoder.encode(texts, range(start, start + len(texts)))

    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="tokenize") as pool:
        pending = collections.deque(pool.submit(encode, s) for s in range(0, len(column), batch_size)[:in_flight])
        following = iter(range(in_flight * batch_size, len(column), batch_size))
        while pending:
            ids = pending.popleft().result()
            for s in itertools.islice(following, 1):
                pending.append(pool.submit(encode, s))
            yield _flat(ids)


def _mapped_batches(tokenized: datasets.Dataset) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Flat token batches of a ``datasets.map`` result, read from its Arrow list column."""
    for chunk in table_of(tokenized).column("input_ids").chunks:
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
        yield chunk.flatten().to_numpy(zero_copy_only=False), lengths


@dataclass(frozen=True)
class FIMSettings:
    """``pack.fim_rate`` / ``fim_spm_rate`` / ``fim_seed`` (:mod:`data_pipeline.tokenizer.fim`)."""

    rate: float = 0.0
    spm_rate: float = 0.0
    seed: int = 0


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
    dataset: datasets.Dataset, tokenizer_file: str, sha: str, text_field: str, num_proc: int, batch_size: int,
    fim: FIMSettings | None = None, shard: int = 0,
) -> datasets.Dataset:
    return dataset.map(
        _Encode(tokenizer_file, text_field, single_threaded=num_proc > 1, fim=fim, shard=shard),
        batched=True,
        with_indices=True,
        batch_size=batch_size,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=dataset.column_names,
        # The function pickles to file paths, which say nothing about the tokenizer's contents:
        # fingerprint on what determines the output instead (num_proc does not).
        new_fingerprint=hashlib.sha256(
            f"{dataset._fingerprint}|{sha}|{text_field}|{fim}|{shard}|tokenize_pack-v1".encode()
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
    fim: FIMSettings | None = None,
    shard: int = 0,
) -> Path:
    """Tokenize ``dataset[text_field]`` and write packed shards (EOS after each document) to ``output_dir``.

    Empty documents are skipped and counted in meta.json as ``num_empty_skipped``. ``fim`` rearranges
    a share of the documents for fill-in-the-middle, drawn per (seed, ``shard``, row). Returns ``output_dir``.
    """
    tokenizer_dir = Path(tokenizer_dir)
    tokenizer_file = tokenizer_dir / TOKENIZER_FILE
    tok_meta = read_tokenizer_meta(tokenizer_dir)
    sha = file_sha256(tokenizer_file)
    if text_field not in dataset.column_names:
        raise ValueError(f"text_field {text_field!r} not in dataset columns {dataset.column_names}")

    start = time.perf_counter()
    if fim is not None and fim.rate > 0:
        fim_token_ids(Tokenizer.from_file(str(tokenizer_file)))  # fail before any work without them
    if num_proc > 1:
        with _tokenizers_parallelism(False):
            batches = _mapped_batches(_tokenize(dataset, str(tokenizer_file), sha, text_field, num_proc,
                                                batch_size, fim, shard))
    else:
        batches = _threaded_batches(dataset, _Encode(str(tokenizer_file), text_field, False, fim, shard), batch_size)
    with PackedShardWriter(
        output_dir,
        eos_id=int(tok_meta["eos_id"]),
        vocab_size=int(tok_meta["vocab_size"]),
        padded_vocab_size=int(tok_meta["padded_vocab_size"]),
        shard_tokens=shard_tokens,
        tokenizer_sha256=sha,
    ) as writer:
        for tokens, lengths in batches:
            writer.add_documents(tokens, lengths)
        writer.close({"text_field": text_field, "fim": asdict(fim or FIMSettings())})
    log.info(
        "packed %d documents, %d tokens (%d empty skipped) into %s in %.1fs",
        writer.num_documents,
        writer.num_tokens,
        writer.num_empty_skipped,
        output_dir,
        time.perf_counter() - start,
    )
    return Path(output_dir)


@dataclass
class PackConfig:
    shard_tokens: int = 2**24
    batch_size: int = 1000
    fim_rate: float = 0.0
    """Share of documents packed as fill-in-the-middle (DeepSeek-V3: 0.1); needs the FIM tokens."""
    fim_spm_rate: float = 0.0
    """Share of those in the Suffix-Prefix-Middle order (the rest Prefix-Suffix-Middle)."""
    fim_seed: int = 0

    def validate(self) -> PackConfig:
        if self.shard_tokens <= 0 or self.batch_size <= 0:
            raise ConfigError("pack.shard_tokens and pack.batch_size must be positive")
        for name in ("fim_rate", "fim_spm_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"pack.{name}={getattr(self, name)} must lie in [0, 1]")
        return self

    @property
    def fim(self) -> FIMSettings:
        return FIMSettings(self.fim_rate, self.fim_spm_rate, self.fim_seed)


def given_tokenizer(ctx: Context) -> Path | None:
    """``tokenizer.path`` (a ready tokenizer), or None when the run trains its own."""
    path = ctx.sections["tokenizer"].path
    return None if path is None else Path(path)


def pack_unit(ctx: Context, unit: int) -> dict[str, Any]:
    tokenizer_dir = given_tokenizer(ctx) or ctx.output_dir / TOKENIZER_DIR
    if not (tokenizer_dir / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{tokenizer_dir} missing: run the train_tokenizer stage first, or set "
                                "tokenizer.path to a ready tokenizer")
    docs = read_documents(ctx.output_dir / "kept" / shard_file(unit), columns=["text"])
    start = time.perf_counter()
    out = tokenize_pack(
        docs,
        tokenizer_dir,
        ctx.step_dir / f"part-{unit:05d}",
        shard_tokens=ctx.config.shard_tokens,
        batch_size=ctx.config.batch_size,
        fim=ctx.config.fim,
        shard=unit,
    )
    seconds = time.perf_counter() - start
    meta = json.loads((out / META_FILE).read_text())
    size = sum(len(t.encode("utf-8")) for t in docs["text"])
    return {
        "documents": meta["num_documents"],
        "tokens": meta["num_tokens"],
        "bytes": size,
        "encode_mb_per_s": round(size / 1e6 / max(seconds, 1e-9), 3),
    }


def copy_tokenizer(source: Path, target: Path) -> dict[str, Any]:
    """Publish ``source``'s tokenizer files at ``target`` with a meta.json (written last); returns it."""
    meta = {**read_tokenizer_meta(source), "source": str(source.resolve()),
            "source_tokenizer_sha256": file_sha256(source / TOKENIZER_FILE)}
    with building_dir(target) as tmp:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def merge_unit(ctx: Context, unit: int) -> dict[str, Any]:
    """Link every part's shard files into ``output_dir/shards`` as one packed dataset (after copying
    a given tokenizer to ``output_dir/tokenizer``)."""
    part_dir = ctx.dirs["tokenize_pack"]
    source = given_tokenizer(ctx)
    if source is not None:
        copy_tokenizer(source, ctx.output_dir / TOKENIZER_DIR)
    with building_dir(ctx.output_dir / SHARDS_DIR) as tmp:
        merged: dict[str, Any] | None = None
        shards: list[dict[str, Any]] = []
        for s in range(ctx.num_shards):
            part = part_dir / f"part-{s:05d}"
            meta = json.loads((part / META_FILE).read_text())
            for i, shard in enumerate(meta["shards"]):
                g = len(shards)
                link_or_copy(part / shard["file"], tmp / shard_name(g))
                np.save(tmp / index_name(g), np.load(part / index_name(i)))
                shards.append({**shard, "file": shard_name(g)})
            if merged is None:
                merged = {**meta, "num_tokens": 0, "num_documents": 0, "num_empty_skipped": 0}
            for key in ("num_tokens", "num_documents", "num_empty_skipped"):
                merged[key] += meta[key]
        assert merged is not None
        merged["shards"] = shards
        merged["corpus"] = ctx.corpus  # what the data module checks its data.corpus_dir against
        merged["stages"] = ctx.run_stages
        (tmp / META_FILE).write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
    return {"documents": merged["num_documents"], "tokens": merged["num_tokens"], "shards": len(shards)}


class TokenizePack(Stage):
    """Runs after finalize (and after ``train_tokenizer``, or with ``tokenizer.path``): packs ``kept/``
    into ``output_dir/shards``."""

    name = "tokenize_pack"
    Config = PackConfig
    section = "pack"
    phase = Phase.PUBLISHED
    comes_after = ("train_tokenizer",)

    def settings(self) -> dict[str, Any]:
        """The packing and the tokenizer's settings (and a given tokenizer's content): another
        tokenizer means other tokens."""
        tokenizer = self.sections["tokenizer"]
        settings = {"pack": asdict(self.config), "tokenizer": asdict(tokenizer)}
        if tokenizer.path is not None:
            settings["tokenizer_sha256"] = file_sha256(Path(tokenizer.path) / TOKENIZER_FILE)
        return settings

    def steps(self) -> list[Step]:
        return [self.step(pack_unit), self.step(merge_unit, "merge", units=1)]
