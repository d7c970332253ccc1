"""Token-level cross-entropy: the single entry point every objective's loss goes through.

Local logits (plain tensors) go through a **chunked, in-place** kernel (:class:`ChunkedCrossEntropy`)
so that a bf16 [tokens, vocab] logits tensor never gets an fp32 twin:

- forward: rows are upcast to fp32 a chunk at a time (``chunk_rows``, by default as many rows as fit
  :data:`CHUNK_BYTES` of fp32) to get each row's logsumexp; the target logit is gathered from the
  logits directly. Saved for backward: the logits themselves (no copy), the per-row logsumexp in fp32
  [N] and the targets.
- backward: chunk by chunk, ``(softmax - onehot) * grad_output`` is computed in fp32 and written
  **over the logits buffer** in the logits' dtype, and that buffer is returned as the gradient.
  Extra memory: one fp32 chunk, whatever the number of tokens (about 0.08x the bytes of
  4096 x 102400 bf16 logits, against 6x for ``F.cross_entropy(logits.float())``; see
  ``benchmarks/cross_entropy_memory.py``).

Contract of the in-place backward: **the logits are consumed by the loss**. After ``backward()``
they hold their gradient, so a caller must not read them after the backward (no metrics, no second
loss on them: compute those before the backward, or pass ``inplace_backward=False``). What guards
there are:

- the kernel writes over the logits only when they are an intermediate result of the autograd graph
  (``requires_grad`` and a ``grad_fn``, and, for a view, a base with a ``grad_fn``): a leaf the user
  holds (or a view of one) gets a fresh gradient buffer instead, as does a tensor whose producing
  op saved it for its own backward (e.g. ``logits = x.exp()``);
- writing over a tensor bumps its autograd version counter, so any *other* op of the graph that
  saved the logits (say a z-loss ``logits.logsumexp(-1)``) and whose backward runs after ours fails
  loudly ("modified by an inplace operation") instead of using wrong values; so does a second
  backward through a retained graph;
- after the overwrite the logits (and their base) are marked; calling :func:`cross_entropy` on them
  again before anything else writes to them raises.

The usual producer, the LM head ``hidden @ W.T`` (under autocast too), needs only its inputs for
its backward, never its output, so the weight and hidden-state gradients are exact.

Vocab-parallel logits (tensor parallelism): a DTensor sharded on the vocabulary (its last dim,
``Shard(-1)``, over a 1-D tp mesh: what the column-parallel output head gives, with or without
sequence parallelism) goes through the same chunked in-place kernel on each rank's vocab slice
(:class:`VocabParallelCrossEntropy`), never gathering the logits:

- forward: the row max of the slice, all-reduced (MAX); chunk by chunk in fp32, the slice's sum of
  ``exp(x - max)``; the target logit from the rank whose slice holds the target (0 on the others);
  the last two all-reduced (SUM) in one [2, N] collective; loss per row ``lse - target logit``.
  Uneven shards (a vocabulary not divisible by tp: torch's chunk semantics, possibly empty slices)
  get their vocab offset from the DTensor's layout. The loss is a plain tensor, identical on every
  tp rank (the reduction over rows needs no communication: every rank holds every row).
- backward: no communication; ``(softmax - onehot) * grad_output`` of the slice, written over the
  local shard as above (same guards, applied to the DTensor; the DTensor's own version counter is
  bumped too). The local shard enters through ``DTensor.to_local()``, so its gradient goes back as a
  DTensor of the logits' layout.

This path needs no ``loss_parallel`` context and is not affected by one (the strategy still opens
it): only plain tensors and collectives run inside. Other DTensor layouts (replicated, sharded on
another dim, 2-D meshes) go through ``F.cross_entropy`` on the DTensor (under ``loss_parallel``
where that is what they need), and the loss comes back as a full plain tensor.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

CHUNK_BYTES = 64 * 2**20
"""fp32 working set of one chunk of rows (forward and backward): ``CHUNK_BYTES // (4 * vocab)`` rows
(163 rows for DeepSeek's 102400 vocabulary)."""

_REDUCTIONS = ("sum", "mean", "none")
_CONSUMED = "_dsl_ce_consumed_version"  # attribute set on logits overwritten by the backward


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk so that one chunk upcast to fp32 takes at most :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab))


class ChunkedCrossEntropy(torch.autograd.Function):
    """CE over rows of 2-D ``logits`` [N, V] against ``targets`` [N]; see the module docstring.

    ``apply(logits, targets, ignore_index, reduction, chunk_rows, inplace, owners)``: ``inplace``
    lets the backward overwrite ``logits`` with their gradient; ``owners`` are the caller's tensors
    (weakly held) to mark as consumed once that happened. Returns fp32: a scalar for ``sum`` /
    ``mean`` (``mean`` over non-ignored rows, 0 when there are none), [N] for ``none``.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, chunk_rows, inplace, owners):
        n, _ = logits.shape
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, n, chunk_rows):
                rows = logits[start:start + chunk_rows]
                shift = rows.amax(dim=1, keepdim=True).float()  # exact in any dtype
                shift = shift.masked_fill(shift.isinf(), 0.0)  # rows of -inf: no inf - inf
                # an fp32 copy of the chunk (never the logits themselves); not torch.sub(rows, shift):
                # with mixed dtypes CPU kernels first cast the bf16 input into a hidden fp32 temporary
                exp = rows.to(torch.float32, copy=True).sub_(shift)
                lse[start:start + chunk_rows] = exp.exp_().sum(dim=1).log_().add_(shift.squeeze(1))
                del exp
            target_logit = logits.gather(1, safe.unsqueeze(1)).squeeze(1).float()
            per_row = torch.where(valid, lse - target_logit, 0.0)
        count = valid.sum()
        loss = _reduce(per_row, count, reduction)
        ctx.save_for_backward(logits, lse, targets)
        ctx.ignore_index, ctx.reduction, ctx.chunk_rows, ctx.inplace = ignore_index, reduction, chunk_rows, inplace
        ctx.count = count
        ctx.owners = owners
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        logits, lse, targets = ctx.saved_tensors  # checks nobody wrote over the logits since forward
        valid = targets != ctx.ignore_index
        grad = _softmax_minus_onehot(
            logits, lse, valid, valid, torch.where(valid, targets, 0), grad_output,
            ctx.reduction, ctx.count, ctx.chunk_rows, ctx.inplace,
        )
        if ctx.inplace:
            _mark_consumed(ctx.owners, bump=False)
        return grad, None, None, None, None, None, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """CE over vocab-sharded logits: this rank's slice ``logits`` [N, V_local] of the [N, V] logits,
    columns ``vocab_start ... vocab_start + V_local`` of the vocabulary, against the full ``targets``
    [N] (the same on every rank of ``group``, as is everything but the logits).

    ``apply(logits, targets, vocab_start, group, ignore_index, reduction, chunk_rows, inplace,
    owners)``, otherwise as :class:`ChunkedCrossEntropy`. Forward: the row max (all-reduced MAX),
    then chunk by chunk in fp32 the sum of ``exp(x - max)`` over the slice, and the target logit from
    the rank whose slice holds it (0 elsewhere), both all-reduced (SUM) together: two collectives of
    [N] and [2, N] fp32, whatever the chunking. The loss is the same on every rank. Backward: no
    communication; ``(softmax - onehot) * grad_output`` of this slice, written over it when
    ``inplace``. ``owners`` may be DTensors (the caller's vocab-sharded logits): their version counter
    is bumped too once their local shard has been written over.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index, reduction, chunk_rows, inplace, owners):
        n, local_vocab = logits.shape
        valid, hit, index = _vocab_slice_targets(targets, ignore_index, vocab_start, local_vocab)
        with torch.autocast(logits.device.type, enabled=False):
            if local_vocab:
                shift = logits.amax(dim=1).float()  # exact in any dtype
            else:  # more ranks than vocabulary entries: an empty slice
                shift = torch.full((n,), float("-inf"), device=logits.device)
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
            shift = shift.masked_fill_(shift.isinf(), 0.0)  # rows of -inf: no inf - inf
            stats = torch.zeros(2, n, dtype=torch.float32, device=logits.device)  # sum of exp, target logit
            if local_vocab:
                for start in range(0, n, chunk_rows):
                    chunk = slice(start, start + chunk_rows)
                    exp = logits[chunk].to(torch.float32, copy=True).sub_(shift[chunk].unsqueeze(1))
                    stats[0, chunk] = exp.exp_().sum(dim=1)
                    del exp
                target_logit = logits.gather(1, index.unsqueeze(1)).squeeze(1).float()
                stats[1] = torch.where(hit, target_logit, 0.0)
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
            lse = stats[0].log_().add_(shift)
            per_row = torch.where(valid, lse - stats[1], 0.0)
        count = valid.sum()
        loss = _reduce(per_row, count, reduction)
        ctx.save_for_backward(logits, lse, targets)
        ctx.ignore_index, ctx.reduction, ctx.chunk_rows, ctx.inplace = ignore_index, reduction, chunk_rows, inplace
        ctx.vocab_start, ctx.count, ctx.owners = vocab_start, count, owners
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        logits, lse, targets = ctx.saved_tensors  # checks nobody wrote over the logits since forward
        valid, hit, index = _vocab_slice_targets(targets, ctx.ignore_index, ctx.vocab_start, logits.shape[1])
        grad = _softmax_minus_onehot(
            logits, lse, valid, hit, index, grad_output, ctx.reduction, ctx.count, ctx.chunk_rows, ctx.inplace
        )
        if ctx.inplace:
            _mark_consumed(ctx.owners, bump=True)
        return grad, None, None, None, None, None, None, None, None


def _reduce(per_row: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return per_row.sum()
    if reduction == "mean":
        return per_row.sum() / count.clamp_min(1)
    return per_row


def _vocab_slice_targets(
    targets: torch.Tensor, ignore_index: int, vocab_start: int, local_vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows not ignored, rows whose target lies in this vocab slice, its column there or 0)."""
    valid = targets != ignore_index
    local = targets - vocab_start
    hit = valid & (local >= 0) & (local < local_vocab)
    return valid, hit, torch.where(hit, local, 0)


def _softmax_minus_onehot(
    logits: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor, hit: torch.Tensor, index: torch.Tensor,
    grad_output: torch.Tensor, reduction: str, count: torch.Tensor, chunk_rows: int, inplace: bool,
) -> torch.Tensor:
    """The gradient of the loss w.r.t. ``logits`` [N, V] (all of the vocabulary or one slice of it):
    ``(exp(logits - lse) - onehot) * grad_output``, chunk by chunk in fp32, written over ``logits``
    when ``inplace``. ``hit``: rows whose target column ``index`` is in ``logits``; rows not ``valid``
    (ignored) get 0."""
    n = logits.shape[0]
    minus_onehot = hit.to(torch.float32).neg_().unsqueeze(1)
    index = index.unsqueeze(1)
    scale = grad_output.float().expand(n) if reduction != "none" else grad_output.float().reshape(n)
    if reduction == "mean":
        scale = scale / count.clamp_min(1)
    scale = torch.where(valid, scale, 0.0).unsqueeze(1)
    grad = logits if inplace else torch.empty_like(logits)
    if logits.shape[1] == 0:
        return grad
    direct = logits.dtype == torch.float32  # fp32: compute straight into the gradient's rows
    with torch.autocast(logits.device.type, enabled=False):
        for start in range(0, n, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            rows = logits[chunk]
            if direct:
                probs = torch.sub(rows, lse[chunk].unsqueeze(1), out=grad[chunk])
            else:
                probs = rows.to(torch.float32, copy=True).sub_(lse[chunk].unsqueeze(1))
            probs.exp_().scatter_add_(1, index[chunk], minus_onehot[chunk]).mul_(scale[chunk])
            if not direct:
                grad[chunk].copy_(probs)
            del probs
    return grad


def _mark_consumed(owners: tuple, bump: bool) -> None:
    """Mark the caller's logits (weakly held) as overwritten; ``bump`` their version counter first
    (DTensors: writing over their local shard bumps only the shard's)."""
    for ref in owners:
        owner = ref()
        if owner is not None:
            if bump:
                torch.autograd.graph.increment_version(owner)
            setattr(owner, _CONSUMED, owner._version)


def _producer_saved(tensor: torch.Tensor) -> bool:
    """Whether the op that produced ``tensor`` saved a tensor sharing its storage (its backward would
    read the values we are about to overwrite), e.g. ``exp``, ``sigmoid``, custom Functions."""
    node = tensor.grad_fn
    if node is None:
        return True
    ptr = _storage_ptr(tensor)
    saved: list = []
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                saved.append(getattr(node, name))
            except RuntimeError:  # already freed
                continue
    try:
        saved.extend(getattr(node, "saved_tensors", ()))  # custom autograd Functions
    except RuntimeError:
        pass
    for value in saved:
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, torch.Tensor) and _storage_ptr(v) == ptr:
                return True
    return False


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s data lives (a DTensor's: its local shard's)."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return tensor.untyped_storage().data_ptr()


def _inplace_owners(logits: torch.Tensor, inplace_backward: bool) -> tuple | None:
    """Weak references to ``logits`` and its base when the backward may write over them (see the
    module docstring), else None."""
    _check_not_consumed(logits)
    owner = logits._base if logits._base is not None else logits
    inplace = (
        inplace_backward and torch.is_grad_enabled() and logits.requires_grad
        and owner.grad_fn is not None and not _producer_saved(owner)
    )
    if not inplace:
        return None
    return tuple(weakref.ref(t) for t in {id(logits): logits, id(owner): owner}.values())


def _is_vocab_parallel(logits: DTensor) -> bool:
    """Sharded on the last dim over a 1-D mesh (what the column-parallel head gives)."""
    placements = logits.placements
    return (
        logits.device_mesh.ndim == 1 and len(placements) == 1 and type(placements[0]) is Shard
        and placements[0].dim % logits.ndim == logits.ndim - 1
    )


def _vocab_parallel_cross_entropy(
    logits: DTensor, targets: torch.Tensor, ignore_index: int, reduction: str,
    inplace_backward: bool, chunk_rows: int | None,
) -> torch.Tensor:
    vocab = logits.shape[-1]
    if isinstance(targets, DTensor):
        targets = targets.full_tensor()
    if targets.numel() != logits.numel() // max(vocab, 1):
        raise ValueError(f"cross_entropy: targets {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits.shape)} without their vocab dim")
    owners = _inplace_owners(logits, inplace_backward)
    mesh = logits.device_mesh
    local_shape, offset = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    local = logits.to_local()  # differentiable: its gradient goes back as a DTensor of the same layout
    if tuple(local.shape) != tuple(local_shape):
        raise RuntimeError(f"cross_entropy: local logits {tuple(local.shape)} are not the expected "
                           f"shard {tuple(local_shape)} of {tuple(logits.shape)}")
    local_vocab = local.shape[-1]
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(max(local_vocab, 1))
    if rows < 1:
        raise ValueError(f"cross_entropy: chunk_rows must be >= 1, got {rows}")
    return VocabParallelCrossEntropy.apply(
        local.reshape(targets.numel(), local_vocab), targets.reshape(-1).to(local.device), offset[-1], mesh.get_group(),
        ignore_index, reduction, rows, owners is not None, owners or (),
    )


def _check_not_consumed(logits: torch.Tensor) -> None:
    for t in (logits, logits._base):
        if t is not None and getattr(t, _CONSUMED, None) == t._version:
            raise RuntimeError(
                "cross_entropy: these logits were overwritten with their gradient by a previous "
                "cross_entropy backward (the logits are consumed by the loss). Compute what else needs "
                "them before the backward, or pass inplace_backward=False."
            )


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "sum",
    *,
    inplace_backward: bool = True,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """CE over the last dim of ``logits`` [..., vocab] against ``targets`` [...]; ``sum`` by default so
    callers normalise by the token count of the whole optimizer step, not of one micro-batch.

    Computed in fp32 whatever the logits' dtype; the loss is fp32. ``mean`` averages over the
    non-ignored targets (0 when all are ignored); ``none`` gives the [N] per-position losses of the
    flattened positions (0 at ignored ones). The gradient has the logits' dtype.

    **The logits are consumed**: unless ``inplace_backward=False`` (or the guards in the module
    docstring apply), the backward writes their gradient over them; do not read them afterwards.
    ``chunk_rows`` overrides the rows upcast at a time (default :func:`default_chunk_rows`, of this
    rank's vocab slice for vocab-parallel logits).

    Vocab-parallel logits (a DTensor ``Shard(-1)`` over a 1-D mesh, ``targets`` the full plain
    tensor on every rank) go through the same kernel on the local shard with two all-reduces over
    the mesh's process group; the loss is a plain tensor, the same on every rank, and the gradient a
    DTensor of the logits' layout. Call it on every rank of the mesh (collectives).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    vocab = logits.shape[-1]
    if isinstance(logits, DTensor):
        if _is_vocab_parallel(logits):
            return _vocab_parallel_cross_entropy(logits, targets, ignore_index, reduction, inplace_backward, chunk_rows)
        # Any other layout: torch's DTensor cross-entropy (for logits sharded on the vocabulary
        # otherwise, under the loss_parallel context); the reduced loss comes back as a plain tensor.
        loss = F.cross_entropy(
            logits.reshape(-1, vocab).float(), targets.reshape(-1),
            ignore_index=ignore_index, reduction=reduction,
        )
        return loss.full_tensor() if isinstance(loss, DTensor) else loss
    if targets.numel() != logits.numel() // max(vocab, 1):
        raise ValueError(f"cross_entropy: targets {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits.shape)} without their vocab dim")
    owners = _inplace_owners(logits, inplace_backward)
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(vocab)
    if rows < 1:
        raise ValueError(f"cross_entropy: chunk_rows must be >= 1, got {rows}")
    return ChunkedCrossEntropy.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), ignore_index, reduction, rows,
        owners is not None, owners or (),
    )
