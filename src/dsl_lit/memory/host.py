"""This process's host memory high-water mark, for logs and benchmarks of what loading costs."""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux ``VmHWM``: anonymous memory plus the
    file pages it mapped and touched, e.g. safetensors read through mmap)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
