"""What a checkpoint directory holds, and whether one is usable (no Lightning import: tools that
only read checkpoints, such as the HF export, start fast).

``step-<N>/``: ``shards/*.safetensors`` (every tensor, each rank's shards), ``trainer_state.pt``
(the plain rest), ``config.yaml`` (the resolved run config) and ``meta.json`` (written last: the
step, and every file with its size).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from safetensors import safe_open

SHARDS = "shards"
STATE = "trainer_state.pt"
CONFIG = "config.yaml"
META = "meta.json"


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


