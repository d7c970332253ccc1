"""The grouped expert GEMM's groups as the CUDA kernel needs them, checked on CPU: every group handed to
``torch._grouped_mm`` in bf16 starts at and spans a multiple of 8 rows and none is empty, whoever
calls it (the model's experts, expert parallelism's local experts); the padding is exact, forward
and backward (empty and odd groups), eager and compiled. The GPU twin: tests/e2e/gpu/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from dsl_lit.models.common import moe
from dsl_lit.models.common.moe import BF16_GROUP_MULTIPLE, GroupedExperts, grouped_swiglu

COUNTS = [100, 0, 37, 200, 5, 64, 1, 33]  # empty and odd groups


@pytest.fixture
def offsets_seen(monkeypatch):
    """The ``offs`` of every ``torch._grouped_mm`` call."""
    seen: list[list[int]] = []
    real = torch._grouped_mm

    def watched(a, b, offs=None, **kwargs):
        seen.append(offs.tolist())
        return real(a, b, offs=offs, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", watched)
    return seen


def assert_close_bf16_fused(got: torch.Tensor, want: torch.Tensor) -> None:
    """Compiled against eager in bf16: inductor keeps ``silu(a) * b`` in fp32 and rounds once where
    eager rounds twice, so a hidden value may differ by a bf16 ulp (2^-8 relative) and the sums
    over it by a few ulps of the largest output (seen on CPU: 2 ulps). 4 ulps of the largest value;
    a wrong row or group mapping is off by the values themselves."""
    scale = want.float().abs().max()
    torch.testing.assert_close(got.float(), want.float(), atol=float(4 * 2**-8 * scale), rtol=2**-6)


def _experts() -> tuple[GroupedExperts, GroupedExperts]:
    torch.manual_seed(0)
    grouped = GroupedExperts(8, 32, 48, backend="grouped_mm")
    for w in (grouped.w1, grouped.w2, grouped.w3):
        torch.nn.init.normal_(w, std=0.2)
    split = GroupedExperts(8, 32, 48, backend="split")
    split.load_state_dict(grouped.state_dict())
    return grouped, split


def test_every_bf16_group_is_aligned_and_none_is_empty(offsets_seen):
    grouped, _ = _experts()
    x = torch.randn(sum(COUNTS), 32, dtype=torch.bfloat16)
    counts = torch.tensor(COUNTS)
    grouped.bfloat16()(x, counts)
    # the local experts of expert parallelism call grouped_swiglu directly
    grouped_swiglu(x, counts, grouped.w1, grouped.w2, grouped.w3, "grouped_mm")
    assert len(offsets_seen) == 6
    for offsets in offsets_seen:
        sizes = [b - a for a, b in zip([0, *offsets], offsets)]
        assert all(size % BF16_GROUP_MULTIPLE == 0 and size > 0 for size in sizes), sizes


def test_padding_is_exact_forward_and_backward():
    """Aligned groups against the per-expert matmuls (the split backend), in bf16 on the same inputs:
    outputs and every gradient equal up to bf16 rounding of differently ordered sums (a wrong row
    mapping or a gradient from a padding row would be off by the values themselves)."""
    grouped, split = _experts()
    grouped, split = grouped.bfloat16(), split.bfloat16()
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), 32, dtype=torch.bfloat16, requires_grad=True)
    out, ref = grouped(x, counts), split(x, counts)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, grouped.w1, grouped.w2, grouped.w3], grad)
    want = torch.autograd.grad(ref, [x, split.w1, split.w2, split.w3], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=5e-2, rtol=5e-2)
    assert got[1][1].abs().max() == 0  # the empty group's expert gets no gradient


@pytest.mark.slow
def test_compiled_grouped_experts_match_eager_with_empty_and_odd_groups():
    """Compiled (inductor on CPU, bf16: the grouped GEMM's meta function takes bf16) against eager,
    forward and backward, one graph (fullgraph) whatever the counts: the padded length depends only
    on the shapes, so a second batch of other counts reuses it."""
    grouped, _ = _experts()
    grouped = grouped.bfloat16()
    compiled = torch.compile(grouped, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    for counts in (COUNTS, [0, 0, 400, 8, 9, 23, 0, 0]):
        counts_t = torch.tensor(counts)
        x = torch.randn(sum(COUNTS), 32, dtype=torch.bfloat16, requires_grad=True)
        out, ref = compiled(x, counts_t), grouped(x, counts_t)
        assert_close_bf16_fused(out, ref)
        got = torch.autograd.grad(out.float().square().sum(), [x, grouped.w1])
        want = torch.autograd.grad(ref.float().square().sum(), [x, grouped.w1])
        for g, w in zip(got, want):
            assert_close_bf16_fused(g, w)
    assert moe.BF16_GROUP_MULTIPLE == 8
