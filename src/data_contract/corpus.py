"""Which files make a corpus directory, and a fingerprint of their content.

Why shared: the data pipeline fingerprints its input to decide which finished work is still valid,
and records that fingerprint in the shards it writes (``shards/meta.json`` -> ``corpus``); the data
module recomputes it for ``data.corpus_dir`` to decide whether its cache was built from this
corpus. Both must list and hash files the same way, so the rule is written once, here.

Content, not modification times: an edited file that keeps its size and mtime (a copy with
``cp -p``, a restored backup, a coarse-mtime filesystem) must not pass as unchanged. Files are
hashed with xxh3-128 (about 10 GB/s; ``xxhash`` comes with ``datasets``) while the input's total
size is within a byte budget; beyond it, hashing on every run would cost minutes, so size and
modification time identify the files instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

DOCUMENT_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".txt", ".parquet")
CONTENT_BUDGET_BYTES = 4 << 30  # inputs up to 4 GiB in total are fingerprinted by content
_BLOCK = 1 << 22


def document_files(directory: Path) -> list[str]:
    """Relative (POSIX) paths of the document files under ``directory``, searched recursively, sorted."""
    return sorted(
        p.relative_to(directory).as_posix()
        for p in Path(directory).rglob("*")
        if p.is_file() and p.name.endswith(DOCUMENT_SUFFIXES)
    )


def content_hash(path: Path) -> str:
    """xxh3-128 of the file's bytes, read once per process for a file unchanged since (a build asks
    for the corpus fingerprint several times: whether its cache is current, its settings'
    fingerprint, the build's own check; each once read up to 4 GiB)."""
    st = Path(path).stat()
    return _hash_of(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@functools.lru_cache(maxsize=4096)
def _hash_of(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    """Keyed by what changes when the file is written (ctime moves even when mtime is set back)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def file_listing(root: Path, files: Sequence[str], budget_bytes: int) -> list[list[Any]]:
    """``[path, size, "xxh3:<hash>"]`` per file when their total size is within ``budget_bytes``,
    else ``[path, size, "mtime:<ns>"]``."""
    stats = [(rel, (Path(root) / rel).stat()) for rel in files]
    by_content = sum(st.st_size for _, st in stats) <= budget_bytes
    return [
        [
            rel,
            st.st_size,
            f"xxh3:{content_hash(Path(root) / rel)}" if by_content else f"mtime:{st.st_mtime_ns}",
        ]
        for rel, st in stats
    ]


def listing_digest(listing: list[list[Any]]) -> str:
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()


def corpus_record(directory: str | Path, budget_bytes: int = CONTENT_BUDGET_BYTES) -> dict[str, str]:
    """What a build records about the corpus directory it read: its resolved path and fingerprint."""
    root = Path(directory).resolve()
    return {
        "path": str(root),
        "fingerprint": listing_digest(file_listing(root, document_files(root), budget_bytes)),
    }
