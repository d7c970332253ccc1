"""The ``near_dedup`` section's settings: the dedup machinery (``lsh_bands``, ``near_dedup_index``,
``near_dedup_cluster``) reads them, ``stages/near_dedup.py`` runs the stage they configure.

Why here and not in the stage's file: the modules of this room take the settings as their argument;
with the class beside the stage they would point up at the stage that imports them.
"""

from __future__ import annotations

import dataclasses as dc
from dataclasses import dataclass

from data_contract.errors import ConfigError
from data_pipeline.stage import check_fraction


@dataclass
class NearDedupConfig:
    ngram: int = 5  # words per shingle
    num_perm: int = 112  # MinHash values per document
    scheme: str = "oph"  # oph (one-permutation + densification) | classic
    seed: int = 1
    threshold: float = 0.8  # Jaccard similarity from which a document is a near duplicate
    min_recall: float = 0.95  # LSH candidate probability wanted at exactly `threshold` (picks bands x rows)
    bands: int | None = None  # set both bands and rows to override the choice
    rows: int | None = None
    verify: str = "exact"  # exact (shingle sets) | signature (MinHash estimate) | none
    cluster_partitions: int = 8  # candidate pairs verified and clustered in this many units, then merged
    batch_size: int = 2000  # documents hashed per numpy batch (memory ~ batch_size x words)
    save_index: bool = False  # write output_dir/near_dedup_index for later runs to dedup against
    against_indexes: list[str] = dc.field(default_factory=list)  # earlier runs' indexes

    def validate(self) -> NearDedupConfig:
        for name in ("ngram", "num_perm", "batch_size", "cluster_partitions"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"near_dedup.{name}={getattr(self, name)} must be a positive integer")
        if self.scheme not in ("oph", "classic"):
            raise ConfigError(f"near_dedup.scheme={self.scheme!r} must be oph or classic")
        if self.verify not in ("exact", "signature", "none"):
            raise ConfigError(f"near_dedup.verify={self.verify!r} must be exact, signature or none")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"near_dedup.threshold={self.threshold} must lie in (0, 1), e.g. 0.8")
        check_fraction("near_dedup", "min_recall", self.min_recall)
        if (self.bands is None) != (self.rows is None):
            raise ConfigError("near_dedup.bands and near_dedup.rows go together: set both or neither")
        if self.bands is not None and self.rows is not None:
            if self.bands <= 0 or self.rows <= 0 or self.bands * self.rows > self.num_perm:
                raise ConfigError(
                    f"near_dedup.bands x near_dedup.rows = {self.bands} x {self.rows} must be positive and at "
                    f"most near_dedup.num_perm={self.num_perm}"
                )
        return self
