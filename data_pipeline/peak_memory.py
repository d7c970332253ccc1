"""Peak resident memory of this process during one unit.

Why reset the high-water mark: pool and Ray workers run many units, of several steps, one after
another, and the kernel's lifetime peak (``ru_maxrss``) would charge every unit with the largest
one before it. Linux resets the peak (VmHWM) to the current RSS on writing ``5`` to
``/proc/self/clear_refs``; elsewhere the lifetime peak is what there is.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak() -> None:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, or /proc not writable: the lifetime peak stays
        pass


def peak_mb() -> float:
    """MiB of the peak resident set since ``reset_peak`` (or since the process started)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(maxrss / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)
