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


def available_bytes(device_type: str, processes_per_device: int = 1) -> int | None:
    """Memory one training process can take: a CUDA device's total memory, or on CPU the host's
    available memory (``MemAvailable``) shared by the processes of this machine. None: unknown."""
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(0).total_memory) // max(1, processes_per_device)
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 // max(1, processes_per_device)
    return None
