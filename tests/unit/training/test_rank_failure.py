"""Which exceptions count as a lost peer (the rank-failure report names the lost ranks for those)."""

from __future__ import annotations

import pytest

from dsl_lit.training.callbacks.rank_failure import is_collective_failure


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation",
    "Application timeout caused pair closure",  # gloo: a peer stopped (SIGSTOP) during a barrier
])
def test_a_collective_that_lost_its_peer_is_recognised(message):
    assert is_collective_failure(RuntimeError(message))


@pytest.mark.parametrize("exception", [RuntimeError("shape mismatch: [2, 3] vs [3, 2]"), ValueError("Timed out")])
def test_other_errors_are_not(exception):
    assert not is_collective_failure(exception)
