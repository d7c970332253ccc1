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

Vocab-parallel logits (tensor parallelism): a DTensor sharded on the vocabulary goes through
``F.cross_entropy`` under torch's ``loss_parallel`` context (forward and backward), which the
strategy opens; it computes the loss without gathering the logits, and the replicated loss comes
back as a plain tensor. The chunked in-place kernel is for local tensors only (a follow-up could
make it vocab-parallel: per-shard max/sum-exp all-reduced, the target logit from its owning shard).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

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
        if reduction == "sum":
            loss = per_row.sum()
        elif reduction == "mean":
            loss = per_row.sum() / count.clamp_min(1)
        else:
            loss = per_row
        ctx.save_for_backward(logits, lse, targets)
        ctx.ignore_index, ctx.reduction, ctx.chunk_rows, ctx.inplace = ignore_index, reduction, chunk_rows, inplace
        ctx.count = count
        ctx.owners = owners
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        logits, lse, targets = ctx.saved_tensors  # checks nobody wrote over the logits since forward
        n, _ = logits.shape
        valid = targets != ctx.ignore_index
        safe = torch.where(valid, targets, 0).unsqueeze(1)
        minus_onehot = valid.to(torch.float32).neg_().unsqueeze(1)
        scale = grad_output.float().expand(n) if ctx.reduction != "none" else grad_output.float().reshape(n)
        if ctx.reduction == "mean":
            scale = scale / ctx.count.clamp_min(1)
        scale = torch.where(valid, scale, 0.0).unsqueeze(1)
        grad = logits if ctx.inplace else torch.empty_like(logits)
        direct = logits.dtype == torch.float32  # fp32: compute straight into the gradient's rows
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, n, ctx.chunk_rows):
                chunk = slice(start, start + ctx.chunk_rows)
                rows = logits[chunk]
                if direct:
                    probs = torch.sub(rows, lse[chunk].unsqueeze(1), out=grad[chunk])
                else:
                    probs = rows.to(torch.float32, copy=True).sub_(lse[chunk].unsqueeze(1))
                probs.exp_().scatter_add_(1, safe[chunk], minus_onehot[chunk]).mul_(scale[chunk])
                if not direct:
                    grad[chunk].copy_(probs)
                del probs
        if ctx.inplace:
            for ref in ctx.owners:
                owner = ref()
                if owner is not None:
                    setattr(owner, _CONSUMED, owner._version)
        return grad, None, None, None, None, None, None


def _producer_saved(tensor: torch.Tensor) -> bool:
    """Whether the op that produced ``tensor`` saved a tensor sharing its storage (its backward would
    read the values we are about to overwrite), e.g. ``exp``, ``sigmoid``, custom Functions."""
    node = tensor.grad_fn
    if node is None:
        return True
    ptr = tensor.untyped_storage().data_ptr()
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
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == ptr:
                return True
    return False


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
    ``chunk_rows`` overrides the rows upcast at a time (default :func:`default_chunk_rows`).
    DTensor (vocab-parallel) logits go through ``F.cross_entropy`` under ``loss_parallel``.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    vocab = logits.shape[-1]
    if isinstance(logits, DTensor):
        # Vocab-parallel logits (tensor parallelism): a DTensor sharded on the vocabulary; the loss
        # is computed without gathering them, under torch's loss_parallel context (forward and
        # backward), which the strategy opens. The reduced loss is replicated: hand back a plain tensor.
        loss = F.cross_entropy(
            logits.reshape(-1, vocab).float(), targets.reshape(-1),
            ignore_index=ignore_index, reduction=reduction,
        )
        return loss.to_local() if isinstance(loss, DTensor) else loss
    if targets.numel() != logits.numel() // max(vocab, 1):
        raise ValueError(f"cross_entropy: targets {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits.shape)} without their vocab dim")
    _check_not_consumed(logits)
    owner = logits._base if logits._base is not None else logits
    inplace = (
        inplace_backward and torch.is_grad_enabled() and logits.requires_grad
        and owner.grad_fn is not None and not _producer_saved(owner)
    )
    owners = tuple(weakref.ref(t) for t in {id(logits): logits, id(owner): owner}.values()) if inplace else ()
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(vocab)
    if rows < 1:
        raise ValueError(f"cross_entropy: chunk_rows must be >= 1, got {rows}")
    return ChunkedCrossEntropy.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), ignore_index, reduction, rows, inplace, owners
    )
