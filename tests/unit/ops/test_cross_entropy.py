"""The chunked in-place cross-entropy against ``F.cross_entropy`` on fp32-upcast logits, for local
logits and for vocab-parallel (``Shard(-1)`` DTensor) logits on a 2-process gloo mesh."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsl_lit.ops import compile_chunk_kernels, cross_entropy
from dsl_lit.ops.cross_entropy import default_chunk_rows
from tests.numerics import assert_close_fp32
from tests.ranks import spawn


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


def _close(actual, expected, reduction_len: int, msg: str = ""):
    """fp32 values (every loss, gradients of fp32 logits) within fp32 reordering of their sums;
    gradients in bf16/fp16 are rounded to that dtype: torch's tolerance for it."""
    assert actual.dtype == expected.dtype, msg
    if expected.dtype == torch.float32:
        assert_close_fp32(actual, expected, reduction_len, msg=msg)
    else:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{msg}: {m}")


def _close_grad(actual, expected):
    _close(actual, expected, expected.shape[-1])  # each row's softmax sums over the vocabulary


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
    assert_close_fp32(loss, ref_loss, source.numel())
    _close_grad(grad, ref_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_reductions(dtype, reduction):
    source, targets = _data((3, 6, 40), dtype, seed=1)
    grad_output = torch.rand(18) if reduction == "none" else torch.tensor(0.7)
    loss, grad = _ours(source, targets, reduction, grad_output, chunk_rows=4)
    ref_loss, ref_grad = _reference(source, targets, reduction, grad_output)
    assert loss.shape == ref_loss.shape
    assert_close_fp32(loss, ref_loss, source.numel())
    _close_grad(grad, ref_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_leaf_logits_are_not_written_over(dtype):
    source, targets = _data((4, 5, 30), dtype, seed=2)
    before = source.detach().clone()
    loss = cross_entropy(source, targets, chunk_rows=3)
    loss.backward()
    assert torch.equal(source.detach(), before)
    ref_loss, ref_grad = _reference(source, targets)
    assert_close_fp32(loss.detach(), ref_loss, source.numel())
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
    assert_close_fp32(loss, ref_loss, source.numel())
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
    assert_close_fp32(loss, ref[0], logits.numel())
    _close(h_grad, ref[1], 70 * 16)  # through the softmax over 70 and the 16-wide head
    _close(w_grad, ref[2], 18 * 16)  # and over the 18 tokens
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


def _z_loss(logits, targets):
    """PaLM's z-loss as a copied recipe would write it: from the logits, by autograd."""
    valid = targets != -100
    return 1e-2 * logits.float().logsumexp(-1)[valid].square().sum() / valid.sum()


# Other ops on the logits, each a function of (logits, targets) -> scalar. The z-loss (logsumexp saves
# its input and output), a squared-logits penalty, a distillation term (log_softmax saves its output)
# and a loss on a view of the logits.
_EXTRA_LOSSES = {
    "z_loss": _z_loss,
    "pow2": lambda logits, targets: logits.float().pow(2).mean(),
    "distill": lambda logits, targets: -(F.log_softmax(logits.float(), -1) * torch.linspace(0, 1, logits.shape[-1])).sum(),
    "view": lambda logits, targets: logits[:, 1:, :7].float().sum(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("before", [True, False], ids=["extra-first", "extra-after"])
@pytest.mark.parametrize("extra", list(_EXTRA_LOSSES))
def test_another_loss_on_the_same_logits_gets_the_out_of_place_gradient(dtype, before, extra):
    """A z-loss (or any op) on the logits, whichever order autograd runs the backwards in: the gradient
    is the out-of-place one, and the logits' buffer still holds it (no second buffer)."""
    source, targets = _data((3, 4, 25), dtype, seed=8)
    fn = _EXTRA_LOSSES[extra]

    def run(inplace):
        source.grad = None
        logits = source * 1
        seen = []
        logits.register_hook(seen.append)  # registered first: must still see the complete gradient
        logits.retain_grad()
        other = fn(logits, targets) if before else None
        loss = cross_entropy(logits, targets, chunk_rows=5, inplace_backward=inplace)
        (loss + (other if before else fn(logits, targets))).backward()
        assert torch.equal(logits.grad, seen[0])
        return source.grad.clone(), seen[0], logits

    grad, seen, logits = run(inplace=True)
    ref_grad, ref_seen, _ = run(inplace=False)
    if dtype == torch.float32:
        assert torch.equal(grad, ref_grad)  # the same fp32 sums, bit for bit
    else:  # ours adds the other term in fp32 and rounds once; autograd rounds, then adds in bf16: an ulp
        torch.testing.assert_close(grad, ref_grad, rtol=1.6e-2, atol=2**-8 * ref_grad.abs().max().item())
    assert torch.equal(seen, grad) and seen.data_ptr() == logits.data_ptr()  # written over the logits


def test_extra_losses_also_on_a_view_passed_to_the_loss():
    """``cross_entropy(logits.view(-1, vocab), ...)`` with a z-loss on ``logits``: the write waits for
    the base's consumers too."""
    source, targets = _data((3, 4, 25), torch.float32, seed=9)

    def run(inplace):
        source.grad = None
        logits = source * 1
        z = _z_loss(logits, targets)
        (cross_entropy(logits.view(-1, 25), targets.view(-1), inplace_backward=inplace) + z).backward()
        return source.grad.clone(), logits

    grad, logits = run(True)
    assert torch.equal(grad, run(False)[0])
    assert torch.equal(logits.detach(), grad)  # consumed: the base's buffer holds the gradient
    # a hook on that view added after the call would see an incomplete gradient: refused
    logits = source * 1
    view = logits.view(-1, 25)
    loss = cross_entropy(view, targets.view(-1))
    view.register_hook(lambda g: g * 2)
    with pytest.raises(RuntimeError, match="incomplete gradient"):
        (loss + _z_loss(logits, targets)).backward()


def test_several_losses_on_one_buffer():
    """Two cross-entropies on the same logits (and one on a view of them): the first is written over
    the buffer, the others get their own; the gradient is the sum."""
    source, targets = _data((3, 4, 25), torch.float32, seed=10)
    other = torch.randint(0, 25, (3, 4), generator=torch.Generator().manual_seed(1))

    def run(inplace):
        source.grad = None
        logits = source * 1
        loss = (cross_entropy(logits, targets, inplace_backward=inplace)
                + cross_entropy(logits, other, inplace_backward=inplace)
                + cross_entropy(logits[:2], other[:2], inplace_backward=inplace))
        loss.backward()
        return source.grad.clone()

    assert_close_fp32(run(True), run(False), 3 * 25)


def test_autograd_grad_writes_at_once_and_captures_the_right_gradient():
    """``torch.autograd.grad`` (and ``backward(inputs=...)``) may hand out the logits' gradient before
    any hook runs: the backward writes it at once, as before, so a captured logits gradient is right;
    an op that saved the logits and runs after it is refused loudly, never wrong."""
    source, targets = _data((3, 4, 25), torch.float32, seed=11)
    ref_loss, ref_grad = _reference(source, targets)
    logits = source * 1
    logits_grad, source_grad = torch.autograd.grad(cross_entropy(logits, targets), [logits, source])
    _close_grad(logits_grad, ref_grad)
    _close_grad(source_grad, ref_grad)
    assert logits_grad.data_ptr() == logits.data_ptr()  # written over: the same memory as before
    logits = source * 1
    z = _z_loss(logits, targets)  # created first: its backward runs after ours
    with pytest.raises(RuntimeError, match="inplace"):
        torch.autograd.grad(cross_entropy(logits, targets) + z, [source])
    # opting out works there too
    logits = source * 1
    z = _z_loss(logits, targets)
    (got,) = torch.autograd.grad(cross_entropy(logits, targets, inplace_backward=False) + z, [source])
    source.grad = None
    logits = source * 1
    (cross_entropy(logits, targets, inplace_backward=False) + _z_loss(logits, targets)).backward()
    assert torch.equal(got, source.grad)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_create_graph_and_retained_graph():
    source, targets = _data((2, 3, 20), torch.float32, seed=12)
    _, ref_grad = _reference(source, targets)
    source.grad = None
    logits = source * 1
    loss = cross_entropy(logits, targets)
    loss.backward(create_graph=True)  # first-order gradient right; no double backward through the kernel
    _close_grad(source.grad.detach(), ref_grad)
    source.grad = None
    logits = source * 1
    loss = cross_entropy(logits, targets)
    loss.backward(retain_graph=True)
    _close_grad(source.grad, ref_grad)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()  # the logits now hold their gradient: refused, not wrong


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_z_loss_from_the_kernels_logsumexp(dtype, reduction):
    """``return_lse=True``: the per-row logsumexp, differentiable; a z-loss built on it has the
    gradient of the reference (F.cross_entropy + logsumexp on fp32 logits), written in place."""
    source, targets = _data((3, 6, 40), dtype, seed=13)
    valid = targets != -100
    weight = 1e-2

    def z_loss(lse):
        return weight * torch.where(valid, lse.square(), 0.0).sum() / valid.sum()

    source.grad = None
    logits = source * 1
    loss, lse = cross_entropy(logits, targets, reduction=reduction, chunk_rows=4, return_lse=True)
    assert lse.shape == targets.shape and lse.dtype == torch.float32
    (loss + z_loss(lse)).backward()
    grad = source.grad.clone()
    assert torch.equal(logits.detach(), grad)  # in place: no other buffer

    reference = source.detach().clone().requires_grad_()
    flat = reference.float().reshape(-1, 40)
    ref_loss = F.cross_entropy(flat, targets.reshape(-1), reduction=reduction)
    ref_lse = flat.logsumexp(-1).view(targets.shape)
    (ref_loss + z_loss(ref_lse)).backward()
    assert_close_fp32(loss.detach(), ref_loss.detach(), source.numel())
    assert_close_fp32(lse.detach(), ref_lse.detach(), 40)
    _close_grad(grad, reference.grad)
    # the z-loss alone (the loss unused) and a z-loss only through lse also work
    source.grad = None
    logits = source * 1
    _, lse = cross_entropy(logits, targets, reduction=reduction, return_lse=True)
    z_loss(lse).backward()
    reference.grad = None
    z_loss(reference.float().logsumexp(-1)).backward()
    _close_grad(source.grad, reference.grad)


@pytest.mark.parametrize("backend, dtype", [
    ("aot_eager", torch.float32), ("aot_eager", torch.bfloat16), ("inductor", torch.bfloat16),
], ids=["aot_eager-fp32", "aot_eager-bf16", "inductor-bf16"])
def test_compiled_chunk_kernels_give_the_eager_results(backend, dtype):
    """``compile_chunk_kernels`` (what ``trainer.compile`` turns on): the same loss, logsumexp and
    in-place gradient as eager, with ragged chunks and a second token count (a dynamic graph), the
    z-loss's softmax scale, another loss's gradient added, and tp's vocab-slice kernel (one rank);
    fp32 within fp32 reordering, bf16 gradients within one bf16 rounding of the eager ones."""
    def run(shape, z=False, extra=None):
        source, targets = _data(shape, dtype, seed=shape[0])
        logits = source * 1
        loss, lse = cross_entropy(logits, targets, chunk_rows=4, return_lse=True)
        total = loss + (lse.square().mean() if z else 0) + (extra(logits, targets) if extra else 0)
        total.backward()
        return loss.detach(), lse.detach(), source.grad, logits

    cases = [((5, 33), False, None), ((9, 33), False, None), ((6, 40), True, None), ((6, 40), False, _z_loss)]
    eager = [run(*case) for case in cases]
    compile_chunk_kernels(backend)
    try:
        compiled = [run(*case) for case in cases]
    finally:
        compile_chunk_kernels(None)
    for (shape, *_), (loss, lse, grad, logits), (ref_loss, ref_lse, ref_grad, _) in zip(cases, compiled, eager):
        assert_close_fp32(loss, ref_loss, math.prod(shape))
        assert_close_fp32(lse, ref_lse, shape[-1])
        assert torch.equal(logits.detach(), grad)  # still written over the logits
        if dtype == torch.float32:
            assert_close_fp32(grad, ref_grad, shape[-1])
        else:
            torch.testing.assert_close(grad, ref_grad, rtol=2**-7, atol=2**-8 * ref_grad.abs().max().item())


def test_z_loss_costs_no_memory():
    """The fused z-loss allocates nothing of the logits' size (the probe of the next test)."""
    tokens, vocab, chunk = 256, 1000, 16
    g = torch.Generator().manual_seed(14)
    data = torch.randn(tokens, vocab, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    anchor = torch.zeros((), requires_grad=True)
    logits = _Producer.apply(anchor, data)
    with _AllocationProbe() as probe:
        loss, lse = cross_entropy(logits, targets, chunk_rows=chunk, return_lse=True)
        (loss + 1e-4 * lse.square().sum()).backward()
    assert max(probe.largest.values()) <= chunk * vocab * 4 < tokens * vocab * 2


def test_no_grad_forward_and_bad_reduction():
    source, targets = _data((2, 3, 11), torch.bfloat16, seed=9)
    logits = source * 1
    before = logits.detach().clone()
    with torch.no_grad():
        loss = cross_entropy(logits, targets, reduction="mean")
    assert_close_fp32(loss, _reference(source, targets, "mean")[0], source.numel())
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
        inputs = {_storage(t).data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t).data_ptr() not in inputs:
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), _storage(t).nbytes())
        return out


def _storage(t: torch.Tensor):
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


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


# --- vocab-parallel logits: a DTensor sharded on the vocabulary over a 2-rank gloo mesh ---------------

def _check_vocab_parallel_leaf(mesh: DeviceMesh, shape, dtype, reduction, ignore, parallel_ctx) -> None:
    """Logits ``leaf * 1`` of a vocab-sharded leaf: loss and the leaf's full gradient equal the
    single-process reference; the local shard was written over; reuse is refused."""
    case = f"{shape} {dtype} {reduction} ignore={ignore} loss_parallel={parallel_ctx}"
    source, targets = _data(shape, dtype, seed=shape[-1], ignore=ignore)
    rows = targets.numel()
    grad_output = torch.rand(rows, generator=torch.Generator().manual_seed(1)) if reduction == "none" else None
    ref_loss, ref_grad = _reference(source, targets, reduction, grad_output)
    leaf = distribute_tensor(source.detach(), mesh, [Shard(-1)]).requires_grad_()
    context = loss_parallel() if parallel_ctx else contextlib.nullcontext()
    with context:
        logits = leaf * 1  # an intermediate of the graph: written over
        loss = cross_entropy(logits, targets, reduction=reduction, chunk_rows=3)
        (loss if grad_output is None else loss * grad_output).sum().backward()
    assert not isinstance(loss, DTensor) and loss.dtype == torch.float32, case
    assert loss.shape == ref_loss.shape, case
    if ignore < 1.0:  # (all ignored: F.cross_entropy's mean is 0 / 0, ours 0)
        assert_close_fp32(loss.detach(), ref_loss, source.numel(), msg=case)
    everyone = [torch.empty_like(loss) for _ in range(mesh.size())]
    dist.all_gather(everyone, loss.detach().contiguous())
    assert all(torch.equal(other, everyone[0]) for other in everyone), f"{case}: loss differs across ranks"
    assert isinstance(leaf.grad, DTensor) and leaf.grad.placements == leaf.placements, case
    if ignore < 1.0:
        _close_grad(leaf.grad.full_tensor(), ref_grad)
    else:
        assert torch.all(loss == 0) and torch.all(leaf.grad.to_local() == 0), case
    # the local shard holds its gradient: consumed, and reuse is refused
    assert torch.equal(logits.detach().to_local(), leaf.grad.to_local()), case
    with pytest.raises(RuntimeError, match="consumed"):
        cross_entropy(logits, targets)


def _check_vocab_parallel_head(mesh: DeviceMesh, vocab: int, dtype, reduction, parallel_ctx) -> None:
    """The column-parallel head's logits (as in tensor_parallel.py): weight and hidden-state gradients
    equal the single-process head + F.cross_entropy on the fp32-upcast logits."""
    case = f"head vocab={vocab} {dtype} {reduction} loss_parallel={parallel_ctx}"
    g = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(2, 9, 16, generator=g).to(dtype)
    weight = (torch.randn(vocab, 16, generator=g) / 4).to(dtype)
    targets = torch.randint(0, vocab, (2, 9), generator=g)
    targets[1, -3:] = -100

    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits_ref = F.linear(h_ref, w_ref)
    ref = F.cross_entropy(logits_ref.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    ref.backward()

    head = torch.nn.Linear(16, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    head = parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    h = hidden.clone().requires_grad_()
    with loss_parallel() if parallel_ctx else contextlib.nullcontext():
        logits = head(h)
        assert isinstance(logits, DTensor) and logits.placements[0].is_shard(dim=2), case
        with torch.no_grad():
            local = logits.to_local()
        first = -(-vocab // mesh.size())  # torch.chunk semantics: 17 + 16 for 33
        assert local.shape[-1] == (first if mesh.get_local_rank() == 0 else vocab - first), case
        storage = local.untyped_storage().data_ptr()
        loss = cross_entropy(logits, targets, reduction=reduction, chunk_rows=4)
        loss.backward()
    assert_close_fp32(loss.detach(), ref.detach(), 18 * vocab, msg=f"{case} loss")  # fp32 from the same logits
    _close(h.grad, h_ref.grad, vocab * 16, msg=f"{case} hidden grad")
    _close(head.weight.grad.full_tensor(), w_ref.grad, 18 * 16, msg=f"{case} weight grad")
    # written over: the local logits hold their gradient (the head's backward needs only its inputs)
    assert logits.detach().to_local().untyped_storage().data_ptr() == storage, case
    assert not torch.equal(logits.detach().full_tensor(), logits_ref.detach()), case


def _check_vocab_parallel_guards(mesh: DeviceMesh) -> None:
    source, targets = _data((3, 4, 25), torch.float32, seed=8)
    # another consumer of the DTensor logits whose backward runs after ours: the exact gradient, the
    # local shard still written over
    leaf = distribute_tensor(source.detach(), mesh, [Shard(-1)]).requires_grad_()
    logits = leaf * 1
    z_loss = logits.pow(2).mean().full_tensor()
    (cross_entropy(logits, targets) + z_loss).backward()
    reference = source.detach().clone().requires_grad_()
    (F.cross_entropy(reference.flatten(0, 1), targets.flatten(), reduction="sum") + reference.pow(2).mean()).backward()
    _close_grad(leaf.grad.full_tensor(), reference.grad)
    assert torch.equal(logits.detach().to_local(), leaf.grad.to_local())
    # the fused z-loss: lse the same on every rank, the gradient that of the reference
    leaf.grad, reference.grad = None, None
    loss, lse = cross_entropy(leaf * 1, targets, return_lse=True)
    (loss + 1e-2 * lse.square().sum()).backward()
    flat = reference.reshape(-1, 25)
    ref_lse = flat.logsumexp(-1)
    (F.cross_entropy(flat, targets.flatten(), reduction="sum") + 1e-2 * ref_lse.square().sum()).backward()
    assert_close_fp32(lse.detach().flatten(), ref_lse.detach(), 25)
    _close_grad(leaf.grad.full_tensor(), reference.grad)
    # a leaf DTensor (as the user holds it) is not written over, and its gradient is exact
    leaf = distribute_tensor(source.detach(), mesh, [Shard(-1)]).requires_grad_()
    before = leaf.detach().full_tensor()
    cross_entropy(leaf, targets).backward()
    assert torch.equal(leaf.detach().full_tensor(), before)
    _close_grad(leaf.grad.full_tensor(), _reference(source, targets)[1])
    # opting out keeps intermediate logits too; no grad: no write, same loss
    logits = leaf * 1
    cross_entropy(logits, targets, inplace_backward=False).backward()
    assert torch.equal(logits.detach().full_tensor(), before)
    with torch.no_grad():
        loss = cross_entropy(leaf * 1, targets, reduction="mean")
    assert_close_fp32(loss, _reference(source, targets, "mean")[0], source.numel())


def _check_vocab_parallel_allocations(mesh: DeviceMesh) -> None:
    """No fp32 tensor of the local logits' size (nor a separate gradient) is allocated."""
    tokens, vocab, chunk = 256, 1000, 16
    g = torch.Generator().manual_seed(10)
    data = distribute_tensor(torch.randn(tokens, vocab, generator=g).to(torch.bfloat16), mesh, [Shard(-1)])
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    anchor = torch.zeros((), requires_grad=True)
    local_vocab = vocab // mesh.size()
    for context in (contextlib.nullcontext(), loss_parallel()):
        logits = _Producer.apply(anchor, data)
        with context, _AllocationProbe() as probe:
            cross_entropy(logits, targets, chunk_rows=chunk).backward()
        assert max(probe.largest.values()) <= chunk * local_vocab * 4 < tokens * local_vocab * 2
    # the probe does see loss_parallel's full-size fp32 buffers of the local shard
    logits = _Producer.apply(anchor, data)
    with loss_parallel(), _AllocationProbe() as probe:
        F.cross_entropy(logits.float(), targets, reduction="sum").backward()
    assert probe.largest[torch.float32] >= tokens * local_vocab * 4


# (shape, dtype, reduction, fraction of ignored targets): vocab 40 splits evenly, 33 as 17 + 16,
# 3 as 2 + 1, 1 as 1 + 0; [batch, seq, vocab] and [tokens, vocab] logits
_LEAF_CASES = [
    ((2, 7, 40), torch.float32, "sum", 0.2),
    ((2, 7, 40), torch.bfloat16, "sum", 0.2),
    ((2, 7, 33), torch.bfloat16, "mean", 0.2),
    ((2, 7, 33), torch.float32, "none", 0.2),
    ((14, 33), torch.float32, "mean", 0.2),
    ((5, 3), torch.bfloat16, "sum", 0.3),
    ((4, 1), torch.float32, "sum", 0.3),  # one vocabulary entry: rank 1's slice is empty
    ((2, 7, 40), torch.bfloat16, "mean", 1.0),  # all ignored: 0 loss, 0 gradient
    ((2, 7, 33), torch.float32, "sum", 1.0),
]


def _vocab_parallel_worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)  # two processes on two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for parallel_ctx in (False, True):
            for shape, dtype, reduction, ignore in _LEAF_CASES:
                _check_vocab_parallel_leaf(mesh, shape, dtype, reduction, ignore, parallel_ctx)
            for vocab, dtype, reduction in [(40, torch.float32, "sum"), (33, torch.bfloat16, "mean")]:
                _check_vocab_parallel_head(mesh, vocab, dtype, reduction, parallel_ctx)
        _check_vocab_parallel_guards(mesh)
        _check_vocab_parallel_allocations(mesh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_matches_one_process(tmp_path):
    spawn(_vocab_parallel_worker, args=(2, str(tmp_path / "init")), nprocs=2)
