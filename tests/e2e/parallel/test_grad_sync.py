"""Overlapped data-parallel gradient reduction on real gloo process groups: buckets start during
the last micro-batch's backward, and the result is the mean of the ranks' accumulated gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsl_lit.parallel.grad_sync import OverlappedGradientReducer
from tests.e2e.parallel.test_zero1 import _grads, _model
from tests.numerics import assert_close_fp32
from tests.ranks import spawn


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, reference = _model(), _model()
        reducer = OverlappedGradientReducer(model, bucket_numel=2000)  # many small buckets
        assert len(reducer.buckets) > 3
        data = torch.randint(0, 64, (world, 2, 2, 17), generator=torch.Generator().manual_seed(0))
        for r in range(world):  # reference: every rank's two micro-batches, then the mean over ranks
            for micro in range(2):
                _grads(reference, data[r, micro])
        _grads(model, data[rank, 0])  # first micro-batch: accumulates locally, nothing is sent
        assert all(b.work is None for b in reducer.buckets)
        reducer.arm()
        _grads(model, data[rank, 1])  # last micro-batch: buckets launch from the backward hooks
        assert reducer.launched_in_backward == len(reducer.buckets)
        reducer.wait()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_close_fp32(p.grad, q.grad / world, world * 2 * 2 * 16, msg=name)  # every rank's targets
        reducer.remove_hooks()
    finally:
        dist.destroy_process_group()


def test_overlapped_reduction_is_the_mean_and_starts_in_backward(tmp_path):
    spawn(_worker, args=(2, str(tmp_path / "init")), nprocs=2)
