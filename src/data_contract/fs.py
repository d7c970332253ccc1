"""Atomic publication of directories: readers see either the old complete one or the new one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def publish_dir(tmp_dir: Path, output_dir: Path) -> None:
    """Move a finished ``tmp_dir`` to ``output_dir`` by rename; an older one there is replaced.

    Both must be on the same filesystem (callers build ``tmp_dir`` beside ``output_dir``).
    """
    tmp_dir, output_dir = Path(tmp_dir), Path(output_dir)
    if output_dir.exists():
        trash = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.old-"))
        output_dir.rename(trash / output_dir.name)
        tmp_dir.rename(output_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp_dir.rename(output_dir)


def current_umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``):
    setting it to read it back would race with threads creating files meanwhile."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give a file the mode ``open()`` would have (``0o666`` less the umask): for writers that
    create theirs private (safetensors' ``save_file`` writes ``-rw-------``)."""
    os.chmod(path, 0o666 & ~current_umask())
