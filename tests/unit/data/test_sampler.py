"""GlobalBatchSampler: deterministic, resumable, and independent of the data-parallel layout."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest

from data_contract.errors import ConfigError
from dsl_lit.data.sampler import GlobalBatchSampler, epoch_permutation, num_windows

N, G, SEED = 37, 8, 1234  # N not a multiple of G: global batches straddle epochs


def batches(
    dp_rank: int = 0, dp_size: int = 1, consumed: int = 0, count: int = 12, **kw: int
) -> list[list[int]]:
    args = {"num_windows": N, "global_batch_size": G, "seed": SEED, **kw}
    sampler = GlobalBatchSampler(dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed, **args)
    return list(islice(sampler, count))


def test_num_windows() -> None:
    assert num_windows(257, 256) == 1 and num_windows(256, 256) == 0 and num_windows(1025, 256) == 4
    assert num_windows(0, 8) == 0


def test_permutation_is_fixed_across_machines() -> None:
    # Pinned values: a change here means runs no longer reproduce their data order.
    assert epoch_permutation(10, 1234).tolist() == [5, 6, 3, 9, 7, 4, 1, 2, 8, 0]
    assert sorted(epoch_permutation(1000, 7).tolist()) == list(range(1000))


def test_deterministic_and_each_epoch_is_a_permutation() -> None:
    first = batches(count=20)
    assert first == batches(count=20)
    assert first != batches(count=20, seed=SEED + 1)
    flat = [i for b in first for i in b]
    assert all(len(b) == G for b in first)
    epochs = [flat[e * N : (e + 1) * N] for e in range(len(flat) // N)]
    assert all(sorted(ep) == list(range(N)) for ep in epochs)
    assert epochs[0] != epochs[1]  # a new order each epoch (seed + epoch)
    assert (
        epochs[0] == epoch_permutation(N, SEED).tolist()
        and epochs[1] == epoch_permutation(N, SEED + 1).tolist()
    )


def test_resume_equals_uninterrupted() -> None:
    full = batches(count=12)
    for step in (1, 4, 5, 11):
        assert batches(consumed=step * G, count=12 - step) == full[step:]


def test_ranks_slice_the_global_batch() -> None:
    global_batches = batches(count=10)
    for dp in (2, 4, 8):
        per_rank = [batches(dp_rank=r, dp_size=dp, count=10) for r in range(dp)]
        for b in range(10):
            assert [i for r in range(dp) for i in per_rank[r][b]] == global_batches[b]
            assert all(len(per_rank[r][b]) == G // dp for r in range(dp))


def test_resume_under_another_dp_size_continues_the_same_sequence() -> None:
    started_at_dp2 = [batches(dp_rank=r, dp_size=2, count=3) for r in range(2)]
    seen = [i for b in range(3) for r in range(2) for i in started_at_dp2[r][b]]
    resumed_at_dp1 = batches(consumed=3 * G, count=5)
    assert seen + [i for b in resumed_at_dp1 for i in b] == [i for b in batches(count=8) for i in b]
    # and from dp=1 back to dp=4
    resumed_at_dp4 = [batches(dp_rank=r, dp_size=4, consumed=5 * G, count=2) for r in range(4)]
    assert [i for r in range(4) for i in resumed_at_dp4[r][0]] == batches(count=6)[5]


def test_resume_with_a_new_batch_size_skips_nothing() -> None:
    before = [i for b in batches(count=3) for i in b]  # 24 samples at G=8
    after = [i for b in batches(consumed=24, count=3, global_batch_size=4) for i in b]
    assert before + after == [i for b in batches(count=5) for i in b][:36]


def test_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"data\.global_batch_size=6 .*divisible.* 4"):
        GlobalBatchSampler(N, 6, dp_rank=0, dp_size=4, seed=SEED)
    with pytest.raises(ConfigError, match=r"data\.seq_len"):
        GlobalBatchSampler(0, G, dp_rank=0, dp_size=1, seed=SEED)
    with pytest.raises(ValueError, match="dp_rank"):
        GlobalBatchSampler(N, G, dp_rank=2, dp_size=2, seed=SEED)
    assert np.array_equal(epoch_permutation(0, 1), np.zeros(0, dtype=np.int64))
