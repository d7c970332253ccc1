"""Deterministic, resumable, data-parallel-aware sampling of pretraining windows.

Why own the sampler: the sample order must depend only on (seed, position in the global sample
stream), never on the number of processes. Positions count GLOBAL samples, and each global batch
is cut into contiguous per-rank slices, so a run resumed from ``consumed_samples`` continues the
same sequence of global batches even under a different data-parallel degree (torchtitan's and
Lightning's ``DistributedSampler`` shard by world size instead, which changes the order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from data_contract.errors import ConfigError


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` (inputs + next-token labels)."""
    return max(0, (num_tokens - 1) // seq_len)


def epoch_permutation(num_items: int, seed: int) -> np.ndarray:
    """A permutation of ``range(num_items)`` that is the same on every machine and numpy version.

    ``Generator.permutation`` may change between numpy releases; the raw PCG64 stream is fixed by
    the algorithm, so we sort indices by raw 64-bit draws (a stable sort breaks the rare ties).
    """
    keys = np.random.PCG64(seed).random_raw(num_items)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


class GlobalBatchSampler:
    """Infinite iterator of this rank's share (``global_batch_size // dp_size`` indices) of each global batch.

    Global sample ``k`` is ``perm_e[k % num_windows]`` with ``e = k // num_windows`` and ``perm_e``
    drawn from ``seed + e``; global batch ``b`` is samples ``[c + b*G, c + (b+1)*G)`` (``c`` = ``consumed_samples``) and rank ``r`` takes the
    contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of it. Iteration starts at ``consumed_samples``: normally
    a multiple of ``G``, but any position works, so a run may resume with another batch size (a batch
    ramp) and still see every sample once per epoch.
    """

    def __init__(
        self,
        num_windows: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        consumed_samples: int = 0,
        batch_size_at: Callable[[int], int] | None = None,
    ) -> None:
        if num_windows <= 0:
            raise ConfigError(
                f"the dataset holds no full window (num_windows={num_windows}): lower data.seq_len or add data"
            )
        if global_batch_size <= 0:
            raise ConfigError(f"data.global_batch_size={global_batch_size} must be positive")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        if global_batch_size % dp_size:
            raise ConfigError(
                f"data.global_batch_size={global_batch_size} is not divisible by the data-parallel size "
                f"{dp_size}: choose a multiple of {dp_size}"
            )
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must be >= 0")
        self.num_windows = num_windows
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self.local_batch_size = global_batch_size // dp_size
        self.batch_size_at = batch_size_at or (lambda consumed: global_batch_size)
        """Global batch of the step that starts after a number of consumed samples (a batch ramp)."""
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            self._perm_cache = {k: v for k, v in self._perm_cache.items() if k == epoch - 1}  # keep one back
            perm = self._perm_cache[epoch] = epoch_permutation(self.num_windows, self.seed + epoch)
        return perm

    def sample_indices(self, start: int, stop: int) -> list[int]:
        """Window indices of global samples ``[start, stop)`` (may span an epoch boundary)."""
        out: list[int] = []
        k = start
        while k < stop:
            epoch, offset = divmod(k, self.num_windows)
            take = min(stop - k, self.num_windows - offset)
            out.extend(self._perm(epoch)[offset : offset + take].tolist())
            k += take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        batch_start = self.consumed_samples
        while True:
            size = self.batch_size_at(batch_start)
            share = size // self.dp_size
            start = batch_start + self.dp_rank * share
            yield self.sample_indices(start, start + share)
            batch_start += size
