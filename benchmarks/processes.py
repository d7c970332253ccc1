"""What the memory benchmarks measure a process with: its peak resident memory (Linux
``/proc/self/status``, reset through ``clear_refs``), and a free port for a gloo rendezvous."""

from __future__ import annotations

import socket
from pathlib import Path


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``: now, ``VmHWM``: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
