"""Interleaved timing: run competing callables in turn, so machine noise hits all of them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each candidate over ``repeats`` rounds (each round calls every
    candidate once, in order), after ``warmup`` untimed rounds."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(warmup + repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}
