"""How sure a fitted scaling law is: a bootstrap over the sweep's runs.

A law is fitted through one optimum per budget, and each optimum through a handful of noisy toy
runs, so its exponent carries the runs' noise. Resampling the runs with replacement within each
budget (every budget keeps its number of runs, so every resample can still be fitted the same way)
and refitting gives a distribution of laws; its 5th and 95th percentiles bound the exponent and any
extrapolated value, each side a one-sided 95% bound, as the reproduction's seed margins are. A
resample whose fit fails (a budget left with one distinct point) is counted, not dropped silently.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsl_lit.scaling.laws import PowerLaw

SAMPLES = 200
PERCENTILES = (5.0, 95.0)
"""The interval's ends: a two-sided 90% interval, each end a one-sided 95% bound."""

Run = Mapping[str, Any]
LawFit = Callable[[Sequence[Run]], Mapping[str, PowerLaw]]
"""Fits named laws (e.g. ``batch_tokens`` and ``lr``) from runs, each with a ``budget``."""


@dataclass(frozen=True)
class LawSamples:
    """The bootstrap distribution of one fitted law."""

    laws: tuple[PowerLaw, ...]
    failed: int

    def exponent_interval(self) -> tuple[float, float]:
        low, high = np.percentile([law.exponent for law in self.laws], PERCENTILES)
        return float(low), float(high)

    def value_interval(self, x: float) -> tuple[float, float]:
        """The interval of the law's value at ``x`` (e.g. an extrapolated lr at the pretraining's C)."""
        low, high = np.percentile([law(x) for law in self.laws], PERCENTILES)
        return float(low), float(high)

    def to_dict(self) -> dict[str, Any]:
        return {"exponent_interval": list(self.exponent_interval()), "failed": self.failed,
                "samples": [[law.coefficient, law.exponent] for law in self.laws]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LawSamples:
        return cls(tuple(PowerLaw(c, e) for c, e in data["samples"]), int(data["failed"]))


def bootstrap_laws(fit: LawFit, runs: Sequence[Run], samples: int = SAMPLES, seed: int = 0) -> dict[str, LawSamples]:
    """Refit ``fit`` on ``samples`` resamples of ``runs`` (with replacement, within each budget);
    a ``ValueError`` from a fit counts as a failed resample. Seeded: the same runs give the same
    intervals."""
    by_budget: dict[float, list[Run]] = defaultdict(list)
    for run in runs:
        by_budget[float(run["budget"])].append(run)
    rng = np.random.default_rng(seed)
    drawn: dict[str, list[PowerLaw]] = defaultdict(list)
    failed = 0
    for _ in range(samples):
        resample = [group[i] for group in by_budget.values() for i in rng.integers(0, len(group), len(group))]
        try:
            laws = fit(resample)
        except ValueError:
            failed += 1
            continue
        for name, law in laws.items():
            drawn[name].append(law)
    if not drawn:
        raise ValueError(f"every one of {samples} bootstrap resamples failed to fit")
    return {name: LawSamples(tuple(laws), failed) for name, laws in drawn.items()}
