"""Stages ``train_tokenizer`` and ``tokenize_pack`` on the kept documents of a run.

Why per shard and then a merge: tokenizing is the expensive part and parallelises over the kept
shards (each packed on its own, resumable); the merge only links the shard files into one packed
dataset, renumbered in shard order, with one meta.json written last.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from data_pipeline.shard_io import link_or_copy, read_documents, shard_file
from data_pipeline.tokenize_pack import tokenize_pack
from data_pipeline.train_tokenizer import train_tokenizer
from dsl_lit.data.format import (
    DEEPSEEK_SPECIAL_TOKENS,
    META_FILE,
    SHARDS_DIR,
    TOKENIZER_DIR,
    index_name,
    shard_name,
)
from dsl_lit.utils.fs import publish_dir


def _kept_texts(kept_dir: Path, num_shards: int, counter: list[int]) -> Iterator[str]:
    for s in range(num_shards):
        for batch in pq.ParquetFile(kept_dir / shard_file(s)).iter_batches(batch_size=1000, columns=["text"]):
            for text in batch.column(0).to_pylist():
                counter[0] += len(text.encode("utf-8"))
                yield text


def train_unit(ctx: Any, unit: int) -> dict[str, Any]:
    cfg = ctx.cfg.tokenizer
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


def pack_unit(ctx: Any, unit: int) -> dict[str, Any]:
    tokenizer_dir = ctx.output_dir / TOKENIZER_DIR
    if not (tokenizer_dir / META_FILE).is_file():
        raise FileNotFoundError(f"{tokenizer_dir} missing: run the train_tokenizer stage first")
    docs = read_documents(ctx.output_dir / "kept" / shard_file(unit), columns=["text"])
    start = time.perf_counter()
    out = tokenize_pack(
        docs,
        tokenizer_dir,
        ctx.step_dir / f"part-{unit:05d}",
        shard_tokens=ctx.cfg.pack.shard_tokens,
        batch_size=ctx.cfg.pack.batch_size,
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


def merge_unit(ctx: Any, unit: int) -> dict[str, Any]:
    """Link every part's shard files into ``output_dir/shards`` as one packed dataset."""
    part_dir = ctx.dirs["tokenize_pack"]
    out = ctx.output_dir / SHARDS_DIR
    tmp = Path(tempfile.mkdtemp(dir=ctx.output_dir, prefix=f".{SHARDS_DIR}.tmp-"))
    try:
        tmp.chmod(0o755)
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
        (tmp / META_FILE).write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"documents": merged["num_documents"], "tokens": merged["num_tokens"], "shards": len(shards)}
