"""Choosing LSH bands x rows for recall at the threshold, not for a balanced error at it.

Why: a pair of Jaccard ``s`` shares at least one of ``b`` bands of ``r`` rows with probability
``1 - (1 - s**r)**b``. The usual choice balances false positives and false negatives around the
threshold, which misses most pairs lying just above it. Candidates are verified afterwards (exact
Jaccard), so false positives only cost time: we take the (b, r) with the fewest false-positive
candidates (integrated below the threshold) among those that catch at least ``min_recall`` of the
pairs exactly at the threshold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from data_pipeline.dedup.near_dedup_config import NearDedupConfig


def candidate_probability(similarity: float | np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Probability that a pair of the given Jaccard similarity collides in at least one band."""
    s = np.asarray(similarity, dtype=np.float64)
    return 1.0 - (1.0 - s**rows) ** bands


def choose_bands(num_perm: int, threshold: float, min_recall: float) -> tuple[int, int]:
    """(bands, rows) with ``bands * rows <= num_perm`` catching ``min_recall`` of pairs at ``threshold``.

    Among those, the one with the least false-positive mass (candidate probability integrated over
    similarities below ``threshold / 2``, where nothing should ever be a candidate), then more rows.
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must lie in (0, 1), got {threshold}")
    below = np.linspace(0.0, threshold / 2, 64)
    best: tuple[float, int, int] | None = None
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if float(candidate_probability(threshold, bands, rows)) < min_recall:
            continue
        false_mass = float(np.trapezoid(candidate_probability(below, bands, rows), below))
        key = (false_mass, -rows, bands)
        if best is None or key < best:
            best = key
    if best is None:
        raise ValueError(
            f"no bands x rows within num_perm={num_perm} reaches recall {min_recall} at Jaccard {threshold}: "
            "raise num_perm or lower near_dedup.min_recall"
        )
    return best[2], -best[1]


def lsh_shape(cfg: NearDedupConfig) -> tuple[int, int]:
    """(bands, rows) of a near-dedup config: as configured, else chosen for ``min_recall`` at ``threshold``."""
    if cfg.bands is not None and cfg.rows is not None:
        return cfg.bands, cfg.rows
    return choose_bands(cfg.num_perm, cfg.threshold, cfg.min_recall)
