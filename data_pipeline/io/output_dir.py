"""Whose ``output_dir`` is it: the pipeline writes only into a directory it owns.

Why: a run replaces ``kept/``, ``removed/``, ``shards/``, ``tokenizer/`` and ``stats.json`` in its
output directory, so pointed at an unrelated directory it would destroy files it never wrote. A
directory is the pipeline's when it is new or empty (then it gets the marker file) or already
carries the marker. An output directory inside the input would be read back as input by the next
run, so that is refused too.
"""

from __future__ import annotations

import re
from pathlib import Path

from data_contract.errors import ConfigError
from data_pipeline.io.shards import write_json

MARKER = ".data_pipeline.json"
# Step directories of runs from before the marker existed: ``work/<NN>-<step>-<fingerprint>``.
_STEP_DIR = re.compile(r"^\d{2}-[a-z0-9_.]+-[0-9a-f]{12}$")


def _empty_but_logs(directory: Path) -> bool:
    """Is ``directory`` empty but for the command line's logs (``logs/<time>/*.log``, which Hydra
    writes there before a run starts, refused runs included)?"""
    entries = list(directory.iterdir())
    if not entries:
        return True
    if [e.name for e in entries] != ["logs"] or not entries[0].is_dir():
        return False
    runs = list(entries[0].iterdir())
    return all(r.is_dir() and all(f.is_file() and f.suffix == ".log" for f in r.iterdir()) for r in runs)


def _written_before_the_marker(directory: Path) -> bool:
    """An output directory of an earlier version of the pipeline: ``work/`` holds only step directories."""
    work = directory / "work"
    entries = list(work.iterdir()) if work.is_dir() else []
    return bool(entries) and all(e.is_dir() and _STEP_DIR.match(e.name) for e in entries)


def dangling_link_problem(output_dir: str) -> str | None:
    """A one-line reason when ``output_dir`` is a symlink to nothing (Hydra would fail creating its
    log directory under it with a traceback, before any of our checks)."""
    path = Path(output_dir)
    if path.is_symlink() and not path.exists():
        return (f"output_dir={output_dir} is a symbolic link to {path.readlink()}, which does not exist; "
                "create its target or give another output_dir")
    return None


def claim_output_dir(output_dir: str, input_root: Path | None) -> None:
    """Refuse (``ConfigError`` naming ``output_dir``) a directory the pipeline does not own or one
    inside the input; otherwise create it and mark it as the pipeline's.

    ``input_root``: the directory the input is read from (None for a single file).
    """
    problem = dangling_link_problem(output_dir)
    if problem:
        raise ConfigError(problem)
    out = Path(output_dir).resolve()
    if input_root is not None and out.is_relative_to(input_root.resolve()):
        raise ConfigError(
            f"output_dir={output_dir} lies inside the input ({input_root}): the next run would read the "
            "pipeline's own outputs as documents; choose an output_dir outside input.path"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir={output_dir} is a file; give a directory")
    owned = not out.exists() or (out / MARKER).is_file() or _empty_but_logs(out)
    if not owned and not _written_before_the_marker(out):
        raise ConfigError(
            f"output_dir={output_dir} is not empty and holds no {MARKER}, so it was not written by the data "
            "pipeline, which replaces kept/, removed/, shards/, tokenizer/ and stats.json in its output "
            "directory; choose a new or empty output_dir"
        )
    if not (out / MARKER).is_file():
        write_json(
            {"written_by": "data_pipeline", "note": "this directory belongs to the data pipeline"},
            out / MARKER,
        )
