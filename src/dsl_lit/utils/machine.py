"""What machine a measurement ran on, in one line (benchmarks and reports print it beside figures)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_description() -> str:
    """CPU model and whether it has native bf16 (AVX512-BF16 or AMX): bf16 figures depend on it."""
    model = platform.processor() or "unknown CPU"
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = False
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and not found:
                model, found = line.split(":", 1)[1].strip(), True
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return f"{model}; native bf16: {', '.join(native) if native else 'no'}"


def machine_description() -> str:
    """CPU (cores usable by this process), and the GPU when torch sees one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{cpu_description()}; {cores} cores"
    try:
        import torch

        if torch.cuda.is_available():
            text += f"; GPU: {torch.cuda.get_device_name(0)}"
        text += f"; torch {torch.__version__}"
    except ImportError:
        pass
    return text
