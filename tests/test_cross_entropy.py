"""The chunked in-place cross-entropy against ``F.cross_entropy`` on fp32-upcast logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsl_lit.ops import cross_entropy
from dsl_lit.ops.cross_entropy import default_chunk_rows


def _data(shape, dtype, seed=0, ignore=0.2):
    g = torch.Generator().manual_seed(seed)
    source = (3 * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    targets[torch.rand(shape[:-1], generator=g) < ignore] = -100
    return source, targets


def _reference(source, targets, reduction="sum", grad_output=None, ignore_index=-100):
    """Loss and gradient (in the logits' dtype) of F.cross_entropy on fp32-upcast logits."""
    logits = source.detach().clone().requires_grad_()
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    (loss if grad_output is None else loss * grad_output).sum().backward()
    return loss.detach(), logits.grad


def _ours(source, targets, reduction="sum", grad_output=None, **kwargs):
    """Our loss and gradient w.r.t. ``source``, through a non-leaf (the in-place path)."""
    source.grad = None
    logits = source * 1  # an intermediate of the graph, like the head's output: written over
    loss = cross_entropy(logits, targets, reduction=reduction, **kwargs)
    (loss if grad_output is None else loss * grad_output).sum().backward()
    return loss.detach(), source.grad


def _close_grad(actual, expected):
    torch.testing.assert_close(actual, expected)  # dtype-aware: bf16 tolerance for bf16 grads
    assert actual.dtype == expected.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape, chunk_rows", [
    ((5, 33), 2),  # 5 rows in chunks of 2: a ragged last chunk
    ((2, 7, 50), 3),  # [batch, seq, vocab]
    ((3, 4, 97), None),  # the default chunk (all rows at once at this vocab)
    ((4, 9, 101), 5),  # vocab prime, rows not a multiple of the chunk
])
def test_matches_reference_loss_and_gradient(dtype, shape, chunk_rows):
    source, targets = _data(shape, dtype)
    loss, grad = _ours(source, targets, chunk_rows=chunk_rows)
    ref_loss, ref_grad = _reference(source, targets)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    _close_grad(grad, ref_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_reductions(dtype, reduction):
    source, targets = _data((3, 6, 40), dtype, seed=1)
    grad_output = torch.rand(18) if reduction == "none" else torch.tensor(0.7)
    loss, grad = _ours(source, targets, reduction, grad_output, chunk_rows=4)
    ref_loss, ref_grad = _reference(source, targets, reduction, grad_output)
    assert loss.shape == ref_loss.shape
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    _close_grad(grad, ref_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_leaf_logits_are_not_written_over(dtype):
    source, targets = _data((4, 5, 30), dtype, seed=2)
    before = source.detach().clone()
    loss = cross_entropy(source, targets, chunk_rows=3)
    loss.backward()
    assert torch.equal(source.detach(), before)
    ref_loss, ref_grad = _reference(source, targets)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=1e-5)
    _close_grad(source.grad, ref_grad)
    # a view of a leaf writes through to the leaf: not written over either
    source.grad = None
    cross_entropy(source.view(20, 30), targets.view(20), chunk_rows=3).backward()
    assert torch.equal(source.detach(), before)
    _close_grad(source.grad, ref_grad)


def test_ignore_index_rows_get_no_gradient_and_no_loss():
    source, targets = _data((2, 8, 25), torch.bfloat16, seed=3, ignore=0.0)
    targets[0, :5] = 7
    loss, grad = _ours(source, targets, "none", torch.ones(16), ignore_index=7, chunk_rows=3)
    ref_loss, ref_grad = _reference(source, targets, "none", torch.ones(16), ignore_index=7)
    assert torch.all(loss[:5] == 0)
    assert torch.all(grad[0, :5] == 0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    _close_grad(grad, ref_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_all_ignored_gives_zero_loss_and_zero_gradient(dtype, reduction):
    source, targets = _data((3, 4, 20), dtype, seed=4)
    targets.fill_(-100)
    loss, grad = _ours(source, targets, reduction, chunk_rows=5)
    assert not loss.isnan().any() and torch.all(loss == 0)
    assert not grad.isnan().any() and torch.all(grad == 0)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_head_then_loss_gives_the_reference_weight_gradients(autocast):
    """The head's backward needs its inputs, never its output: writing the gradient over the logits
    leaves the weight and hidden-state gradients exact."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 9, 16, generator=g)
    weight = torch.randn(70, 16, generator=g) / 4
    targets = torch.randint(0, 70, (2, 9), generator=g)
    targets[1, -2:] = -100

    def run(loss_fn):
        h = hidden.clone().requires_grad_()
        w = torch.nn.Parameter(weight.clone())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = F.linear(h, w)
            loss = loss_fn(logits)
        loss.backward()
        return loss.detach(), h.grad, w.grad, logits

    loss, h_grad, w_grad, logits = run(lambda x: cross_entropy(x, targets, chunk_rows=4))
    ref = run(lambda x: F.cross_entropy(x.float().flatten(0, 1), targets.flatten(), reduction="sum"))
    assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_grad, ref[1])
    torch.testing.assert_close(w_grad, ref[2])
    assert not torch.equal(logits.detach(), ref[3].detach())  # ours were consumed by the backward


def test_logits_are_consumed_and_reuse_is_refused():
    source, targets = _data((2, 5, 30), torch.float32, seed=6)
    logits = source * 1
    seen = []
    logits.register_hook(lambda grad: seen.append(grad))
    cross_entropy(logits, targets).backward()
    # the gradient is the logits' own buffer, now holding it
    assert seen[0].data_ptr() == logits.data_ptr()
    _close_grad(logits.detach(), _reference(source, targets)[1])
    with pytest.raises(RuntimeError, match="consumed"):
        cross_entropy(logits, targets)
    with pytest.raises(RuntimeError, match="consumed"):
        cross_entropy(logits[:, 1:], targets[:, 1:])
    # opting out keeps them
    logits = source * 1
    before = logits.detach().clone()
    cross_entropy(logits, targets, inplace_backward=False).backward()
    assert torch.equal(logits.detach(), before)
    cross_entropy(logits, targets)


def test_producer_that_saved_its_output_falls_back():
    source, targets = _data((3, 4, 25), torch.float32, seed=7)
    source.grad = None
    loss = cross_entropy(source.exp(), targets)  # exp's backward reads its output
    loss.backward()
    reference = source.detach().clone().requires_grad_()
    F.cross_entropy(reference.exp().flatten(0, 1), targets.flatten(), reduction="sum").backward()
    torch.testing.assert_close(source.grad, reference.grad)


def test_another_consumer_of_the_logits_is_protected_by_the_version_counter():
    source, targets = _data((3, 4, 25), torch.float32, seed=8)
    # its backward runs after ours (created before): autograd refuses the overwritten logits
    logits = source * 1
    z_loss = logits.pow(2).mean()
    with pytest.raises(RuntimeError, match="inplace"):
        (cross_entropy(logits, targets) + z_loss).backward()
    # its backward runs before ours (created after): correct
    source.grad = None
    logits = source * 1
    (cross_entropy(logits, targets) + logits.pow(2).mean()).backward()
    reference = source.detach().clone().requires_grad_()
    logits = reference * 1
    (F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") + logits.pow(2).mean()).backward()
    torch.testing.assert_close(source.grad, reference.grad)


def test_no_grad_forward_and_bad_reduction():
    source, targets = _data((2, 3, 11), torch.bfloat16, seed=9)
    logits = source * 1
    before = logits.detach().clone()
    with torch.no_grad():
        loss = cross_entropy(logits, targets, reduction="mean")
    torch.testing.assert_close(loss, _reference(source, targets, "mean")[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.detach(), before)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, targets, reduction="avg")


class _AllocationProbe(TorchDispatchMode):
    """Records, per dtype, the largest storage an op allocates (an output whose storage is none of
    its inputs' storages), forward and backward alike."""

    def __init__(self):
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.untyped_storage().nbytes())
        return out


class _Producer(torch.autograd.Function):
    """Stands in for the head: hands out a copy of ``data`` as a graph intermediate; its backward
    swallows the logits' gradient and allocates nothing of their size."""

    @staticmethod
    def forward(ctx, anchor, data):
        return data.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros(()), None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_no_fp32_copy_of_the_logits_is_ever_allocated(dtype):
    tokens, vocab, chunk = 256, 1000, 16
    g = torch.Generator().manual_seed(10)
    data = torch.randn(tokens, vocab, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    anchor = torch.zeros((), requires_grad=True)
    logits = _Producer.apply(anchor, data)
    with _AllocationProbe() as probe:  # forward and backward of the loss
        cross_entropy(logits, targets, chunk_rows=chunk).backward()
    # the largest allocation of any dtype is one fp32 chunk: no fp32 copy, no separate gradient
    assert max(probe.largest.values()) <= chunk * vocab * 4 < tokens * vocab * 2
    # the probe does see the naive path's full-size fp32 buffers
    logits = _Producer.apply(anchor, data)
    with _AllocationProbe() as probe:
        F.cross_entropy(logits.float(), targets, reduction="sum").backward()
    assert probe.largest[torch.float32] >= tokens * vocab * 4


def test_default_chunk_is_a_byte_budget():
    assert default_chunk_rows(102400) == 163
    assert default_chunk_rows(10**9) == 1
