"""Checksums of a checkpoint's files, recorded in ``meta.json`` when it is written and compared when
it is resumed, so a file whose bytes changed after the save (a flipped bit, an overwritten block, a
hand-edited header) is caught even when its size did not change.

Why xxh3-128 and not a cryptographic hash: this guards against accidents, not attackers (anyone who
can rewrite a shard can rewrite ``meta.json``), and it hashes a GiB in about 0.35 s from the page
cache on this project's 2-core VM, where blake2b takes 2.6 s and sha256 1.5 s
(``benchmarks/checkpoint_checksum.py``): verifying a checkpoint costs about as much as reading it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20


def file_digest(path: Path, make: Callable[[], Any]) -> str:
    """The hex digest of a file by a ``hashlib``-like constructor, read in 8 MiB chunks into one
    reused buffer."""
    digest = make()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def file_checksum(path: Path) -> str:
    """The checksum ``meta.json`` records for a file."""
    return file_digest(path, xxhash.xxh3_128)


def checksums(root: Path, names: list[str]) -> dict[str, str]:
    """Relative path -> checksum of each of ``names`` under ``root`` (what ``meta.json`` records)."""
    return {name: file_checksum(root / name) for name in names}


def recorded_checksums(checkpoint: Path) -> dict[str, str]:
    """The checksums ``meta.json`` recorded; empty for a checkpoint written before they were
    (those are checked by file sizes only)."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    if meta.get("checksum") != ALGORITHM:
        return {}
    return dict(meta.get("checksums") or {})


def checksum_problem(checkpoint: Path, names: list[str] | None = None) -> str | None:
    """The first file (of ``names``, default all recorded) whose bytes no longer match the checksum
    ``meta.json`` recorded, as a sentence naming it; None if every one matches."""
    recorded = recorded_checksums(checkpoint)
    for name in sorted(recorded) if names is None else names:
        path = checkpoint / name
        if not path.is_file():
            return f"no {name}"
        if file_checksum(path) != recorded[name]:
            return (f"{name} does not match its {ALGORITHM} checksum in meta.json: its bytes changed after "
                    "the checkpoint was written")
    return None
