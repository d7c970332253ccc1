"""What a checkpoint directory holds, and whether one is usable (no Lightning import: tools that
only read checkpoints, such as the HF export, start fast).

``step-<N>/``: ``shards/*.safetensors`` (every tensor, each rank's shards), ``trainer_state.pt``
(the plain rest), ``config.yaml`` (the resolved run config) and ``meta.json`` (written last: the
step, and every file with its size and checksum, :mod:`dsl_lit.checkpoint.integrity`).
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

SHARDS = "shards"
STATE = "trainer_state.pt"
CONFIG = "config.yaml"
META = "meta.json"


class CorruptCheckpoint(Exception):
    """A checkpoint directory that cannot be resumed from; the message names the file and why."""


def file_sizes(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``root`` (what ``meta.json`` records)."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def is_complete(path: Path) -> bool:
    return (path / META).is_file() and (path / STATE).is_file() and (path / SHARDS).is_dir()


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a usable checkpoint directory, or None. Cheap: compares every file with
    the size ``meta.json`` recorded, reads the safetensors headers and the zip directory of the
    trainer state, not the data."""
    if not (path / META).is_file():
        return f"no {META}"
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        return f"unreadable {META} ({err})"
    if not isinstance(meta, dict) or not meta.get("complete"):
        return f"{META} does not mark it complete"
    files = meta.get("files") or {}
    if STATE not in files or not any(name.startswith(f"{SHARDS}/") for name in files):
        return f"{META} lists no {STATE} or no {SHARDS}/"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"no {name}"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {META} recorded {size}"
        if name.endswith(".safetensors"):
            try:
                with safe_open(str(file), framework="pt") as f:
                    f.keys()
            except Exception as err:  # safetensors raises its own SafetensorError for a broken file
                return f"{name} does not open ({err})"
    try:
        with zipfile.ZipFile(path / STATE) as z:
            z.namelist()
    except (OSError, zipfile.BadZipFile) as err:
        return f"{STATE} does not open ({err})"
    return None


def load_plain_state(checkpoint: Path) -> dict[str, Any]:
    """``trainer_state.pt`` read with ``torch.load(weights_only=True)``, the only way we ever read it.

    A corrupt file raises :class:`CorruptCheckpoint` with our own message: torch's for a failed
    weights-only load suggests retrying with ``weights_only=False``, which would unpickle whatever
    code the file holds, so it is never shown (nor chained)."""
    path = checkpoint / STATE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        reason = "it is corrupt, or holds objects other than tensors and plain values"
    except Exception as err:  # torch raises RuntimeError, EOFError, ... for a broken zip
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        reason = "it is corrupt" if "weights_only" in text else f"it is corrupt ({text})"
    raise CorruptCheckpoint(f"{STATE} does not load as a weights-only torch file: {reason}")
