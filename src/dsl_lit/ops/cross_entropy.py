"""Token-level cross-entropy: the single entry point every objective's loss goes through.

Local logits (plain tensors) go through a **chunked, in-place** kernel (:class:`ChunkedCrossEntropy`)
so that a bf16 [tokens, vocab] logits tensor never gets an fp32 twin:

- forward: rows are upcast to fp32 a chunk at a time (``chunk_rows``, by default as many rows as fit
  :data:`CHUNK_BYTES` of fp32) to get each row's logsumexp; the target logit is gathered from the
  logits directly. Saved for backward: the logits themselves (no copy), the per-row logsumexp in fp32
  [N] and the targets.
- backward: chunk by chunk, ``(softmax - onehot) * grad_output`` is computed in fp32 and written
  **over the logits buffer** in the logits' dtype, and that buffer is the logits' gradient.
  Extra memory: one fp32 chunk, whatever the number of tokens (about 0.08x the bytes of
  4096 x 102400 bf16 logits, against 6x for ``F.cross_entropy(logits.float())``; see
  ``benchmarks/cross_entropy_memory.py``).

**Compiled chunks** (:func:`compile_chunk_kernels`, which ``trainer.compile`` calls): the two
per-chunk passes (the forward's sum of ``exp(x - max)``, the backward's ``softmax - onehot``) each
become one fused kernel (``torch.compile``), reading the bf16 chunk once instead of several fp32
passes over a chunk-sized temporary; the chunking, the in-place write and everything below are
unchanged. ``benchmarks/cross_entropy_memory.py`` prints both (a 4096 x 32000 bf16 forward and
backward measured 0.49 s eager, 0.26 s compiled on 2 CPU cores, 2026-11-27). The switch is process-wide, as
torch's own backend flags are: the loss is computed by whatever code calls :func:`cross_entropy`
(objectives, log-probabilities), none of which knows whether the run compiles.

The per-row logsumexp comes back too with ``return_lse=True`` (fp32, differentiable): a z-loss
(PaLM's ``z_weight * mean(lse^2)``, :mod:`dsl_lit.training.pretrain`'s ``objective.z_loss_weight``)
built on it costs nothing more, its gradient ``dz/dlse * softmax`` joining the same chunked pass.

**Other ops on the same logits are safe** (a z-loss computed from the logits before or after the call,
a distillation term, metrics, views of them). How, without detecting anything: the gradient is written
over the logits only once **no op of the graph can still read them**. In a plain ``backward()`` the
kernel's own backward hands autograd a zero placeholder (a scalar expanded to [N, V]: no memory) and
records its output gradient; a gradient hook on the logits, which autograd calls once the gradients
of *all* their consumers have been summed (every op that received the logits, or a view of them, has
run its backward) and before their producer's backward, then writes ``(softmax - onehot) * g`` over
the buffer, adds in fp32 what the other consumers contributed, and hands the buffer on as the logits'
gradient. Whatever order autograd runs the consumers in, none of them reads the logits after the
write: the gradients are those of the out-of-place computation, and the normal path (the loss the
only consumer) uses the memory it always did. Our hook runs before any other hook on the logits
(registered before the call or after), so those see the complete gradient. Which tensor holds the
hook: the logits passed; or, when they are a plain view holding all of their base's elements (the
common ``cross_entropy(logits.view(-1, vocab), ...)``), that base, so that ops on the base are
covered too (a hook or ``retain_grad`` on such a view would see an incomplete gradient: refused).

Where this cannot hold, the backward falls back, never silently wrong:

- a backward that is not a plain ``backward()``: ``torch.autograd.grad(...)``, ``backward(inputs=...)``
  (pipeline schedules' split backward), ``create_graph=True``. Autograd may hand the logits' gradient
  to the caller before any hook runs, so the kernel's backward writes the gradient over the logits
  itself, at once, as it always did; an op that saved the logits and whose backward runs later fails
  loudly through the version counter ("modified by an inplace operation"): compute such a term from
  the returned ``lse``, or pass ``inplace_backward=False``;
- the logits are a leaf the user holds (or a view of one), or their producer saved them for its own
  backward (e.g. ``logits = x.exp()``): a fresh gradient buffer, nothing written over;
- logits that ``reshape`` to [N, V] only by copying (non-contiguous): that private copy is written
  over, never the caller's tensor;
- a second cross-entropy on logits whose in-place gradient is still pending (the same buffer, or a
  view of it): a fresh gradient buffer for the second;
- something outside the graph that saved an alias of the logits (``logits.detach()`` fed to another
  op whose backward runs later), or a second backward through a retained graph: the write bumps the
  logits' version counter, so autograd refuses loudly.

The usual producer, the LM head ``hidden @ W.T`` (under autocast too), needs only its inputs for
its backward, never its output, so the weight and hidden-state gradients are exact.

Contract of the in-place backward: **the logits are consumed by the backward**. After ``backward()``
they hold their gradient, so read them (metrics, other terms) before it. After the overwrite the
logits (and their base) are marked; calling :func:`cross_entropy` on them again before anything else
writes to them raises.

Vocab-parallel logits (tensor parallelism): a DTensor sharded on the vocabulary (its last dim,
``Shard(-1)``, over a 1-D tp mesh: what the column-parallel output head gives, with or without
sequence parallelism) goes through the same chunked in-place kernel on each rank's vocab slice
(:class:`VocabParallelCrossEntropy`), never gathering the logits:

- forward: the row max of the slice, all-reduced (MAX); chunk by chunk in fp32, the slice's sum of
  ``exp(x - max)``; the target logit from the rank whose slice holds the target (0 on the others);
  the last two all-reduced (SUM) in one [2, N] collective; loss per row ``lse - target logit``.
  Uneven shards (a vocabulary not divisible by tp: torch's chunk semantics, possibly empty slices)
  get their vocab offset from the DTensor's layout. The loss (and ``lse``) is a plain tensor,
  identical on every tp rank (the reduction over rows needs no communication: every rank holds every
  row).
- backward: no communication; ``(softmax - onehot) * grad_output`` of the slice, written over the
  local shard as above (same deferral to a hook on the DTensor logits, same guards; the DTensor's
  own version counter is bumped too). The local shard enters through ``DTensor.to_local()``, so its
  gradient goes back as a DTensor of the logits' layout.

This path needs no ``loss_parallel`` context and is not affected by one (the strategy still opens
it): only plain tensors and collectives run inside. Other DTensor layouts (replicated, sharded on
another dim, 2-D meshes) go through ``F.cross_entropy`` on the DTensor (under ``loss_parallel``
where that is what they need), and the loss comes back as a full plain tensor.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

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
_VIEW_NODES = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"})
"""Autograd nodes of plain views: logits made by one of them from a base of the same elements get
their deferred write hooked on the base (see the module docstring)."""
_PENDING: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""(device, storage address) -> the :class:`_Deferred` write still to come over that buffer."""


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk so that one chunk upcast to fp32 takes at most :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def _sum_exp(rows: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """[r] fp32 ``sum(exp(rows - shift))`` of a chunk ``rows`` [r, V] (any dtype), ``shift`` [r, 1]
    fp32. An fp32 copy of the chunk, never the logits themselves; not ``torch.sub(rows, shift)``:
    with mixed dtypes CPU kernels first cast the bf16 input into a hidden fp32 temporary."""
    return rows.to(torch.float32, copy=True).sub_(shift).exp_().sum(dim=1)


def _gradient_chunk(
    rows: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, softmax_scale: torch.Tensor | None,
    index: torch.Tensor, minus_onehot: torch.Tensor, extra: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk's logits gradient in ``rows``' dtype (see :func:`_logits_gradient`), written
    pointwise (the target column by comparison with a column index, not a scatter) so that the
    compiled kernel is one fused pass: read the chunk, write its gradient. Returned, not written over
    ``rows`` here: a compiled function mutating an input that aliases another gave wrong values in a
    trial (torch 2.13, inductor on CPU)."""
    probs = (rows.float() - lse.unsqueeze(1)).exp()
    target = torch.arange(rows.shape[1], device=rows.device) == index
    if softmax_scale is None:
        grad = (probs + torch.where(target, minus_onehot, 0.0)) * scale
    else:
        grad = probs * softmax_scale + torch.where(target, minus_onehot, 0.0)
    if extra is not None:
        grad = grad + extra
    return grad.to(rows.dtype)


class _ChunkKernels:
    """The per-chunk passes in use: eager (None) or compiled (:func:`compile_chunk_kernels`)."""

    sum_exp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = staticmethod(_sum_exp)
    gradient: Callable[..., torch.Tensor] | None = None
    backend: str | None = None


def compile_chunk_kernels(backend: str | None = "inductor") -> None:
    """Run every later :func:`cross_entropy` chunk through ``torch.compile``\ d kernels
    (``backend``: a ``torch.compile`` backend; None: back to eager). Shapes: each call's chunks have
    at most two row counts (full chunks, the last one), and the token count changes with the batch,
    so the kernels compile with automatic dynamic shapes (a second shape makes one dynamic graph)."""
    if backend is None:
        _ChunkKernels.sum_exp, _ChunkKernels.gradient, _ChunkKernels.backend = staticmethod(_sum_exp), None, None
        return
    if _ChunkKernels.backend == backend:
        return
    _ChunkKernels.sum_exp = staticmethod(torch.compile(_sum_exp, backend=backend))
    _ChunkKernels.gradient = staticmethod(torch.compile(_gradient_chunk, backend=backend))
    _ChunkKernels.backend = backend


def chunk_kernels_backend() -> str | None:
    """The ``torch.compile`` backend the chunk kernels run under (None: eager)."""
    return _ChunkKernels.backend


class _Deferred:
    """The in-place gradient of one :func:`cross_entropy` call, written by a hook on ``target`` (the
    logits, or their base) once autograd has summed the gradients of all of its consumers.

    ``values``: the logits' buffer as [N, V] (a detached alias: read, then written over); ``result``:
    the same buffer shaped as ``target``, which the hook returns as its gradient. The kernel's
    backward sets ``write`` (a function of the buffer and what the other consumers contributed) and
    hands autograd ``sentinel`` (zeros, no memory) instead of the gradient."""

    def __init__(self, target: torch.Tensor, rows: torch.Size, owners: tuple, bump: bool,
                 view_guard: tuple | None) -> None:
        self.result = target.detach()
        self.values = _local(self.result).reshape(rows)
        self.version = self.values._version
        self.owners, self.bump = owners, bump
        self.view_guard = view_guard
        """(weak reference to the view passed, its hook dict) when the hook sits on the view's base."""
        self.write: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None
        self.sentinel: torch.Tensor | None = None

    def placeholder(self, like: torch.Tensor) -> torch.Tensor:
        """What the kernel's backward returns instead of the gradient: zeros of ``like``'s shape
        that take no memory, recognised by the hook."""
        self.sentinel = torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
        return self.sentinel

    def hook(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        write, self.write = self.write, None
        if write is None:
            return None  # the loss's backward did not run in this pass: nothing to add
        sentinel, self.sentinel = self.sentinel, None
        if self.values._version != self.version:
            raise RuntimeError(
                "cross_entropy: the logits were modified in place between the loss's forward and its "
                "backward (or a second backward ran through a retained graph); the in-place backward needs "
                "their values: pass inplace_backward=False")
        if self.view_guard is not None:
            view, hooks = self.view_guard
            view = view()
            if len(hooks) > 1 or (view is not None and view.retains_grad):
                raise RuntimeError(
                    "cross_entropy: a gradient hook or retain_grad() on the view of the logits passed to "
                    "cross_entropy saw an incomplete gradient (the in-place backward completes it on their "
                    "base): put it on the base tensor, or pass inplace_backward=False")
        extra = None
        if grad is not None and (sentinel is None or _storage_ptr(grad) != _storage_ptr(sentinel)):
            extra = _as_rows(grad, self.result, self.values.shape)  # what the other consumers contributed
            if _storage_ptr(extra) == _storage_ptr(self.values):
                extra = extra.clone()
        with torch.no_grad():
            write(self.values, extra)
        _mark_consumed(self.owners, self.bump)
        return self.result


def _as_rows(grad: torch.Tensor, like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` (of a tensor laid out as ``like``) as the [N, V] rows of the local buffer."""
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != tuple(like.placements):
            grad = grad.redistribute(like.device_mesh, like.placements)
        grad = grad.to_local()
    return grad.reshape(shape)


class ChunkedCrossEntropy(torch.autograd.Function):
    """CE over rows of 2-D ``logits`` [N, V] against ``targets`` [N]; see the module docstring.

    ``apply(logits, probe, targets, ignore_index, reduction, chunk_rows, mode, deferred)``: ``mode``
    ``"copy"`` (a fresh gradient buffer), ``"private"`` (``logits`` are this call's own copy: written
    over) or ``"inplace"`` (written over, by ``deferred``'s hook in a plain backward, else at once);
    ``probe`` is a leaf of this call (``"inplace"`` only; None otherwise) whose node tells a plain
    ``backward()`` from ``autograd.grad``. Returns fp32 (loss, per-row logsumexp [N]): the loss a
    scalar for ``sum`` / ``mean`` (``mean`` over non-ignored rows, 0 when there are none), [N] for
    ``none``.
    """

    @staticmethod
    def forward(ctx, logits, probe, targets, ignore_index, reduction, chunk_rows, mode, deferred):
        n, _ = logits.shape
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, n, chunk_rows):
                rows = logits[start:start + chunk_rows]
                shift = rows.amax(dim=1, keepdim=True).float()  # exact in any dtype
                shift = shift.masked_fill(shift.isinf(), 0.0)  # rows of -inf: no inf - inf
                lse[start:start + chunk_rows] = _ChunkKernels.sum_exp(rows, shift).log_().add_(shift.squeeze(1))
            target_logit = logits.gather(1, safe.unsqueeze(1)).squeeze(1).float()
            per_row = torch.where(valid, lse - target_logit, 0.0)
        count = valid.sum()
        loss = _reduce(per_row, count, reduction)
        ctx.save_for_backward(logits, lse, targets)
        ctx.set_materialize_grads(False)
        ctx.ignore_index, ctx.reduction, ctx.chunk_rows = ignore_index, reduction, chunk_rows
        ctx.count, ctx.mode, ctx.deferred = count, mode, deferred
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        ctx.create_graph = torch.is_grad_enabled()
        return _chunked_backward(ctx, grad_loss, grad_lse) + (None,) * 6


@once_differentiable
def _chunked_backward(ctx, grad_loss, grad_lse):
    if grad_loss is None and grad_lse is None:
        return None, None
    logits, lse, targets = ctx.saved_tensors  # checks nobody wrote over the logits since forward
    valid = targets != ctx.ignore_index
    write = functools.partial(
        _logits_gradient, lse=lse, valid=valid, hit=valid, index=torch.where(valid, targets, 0),
        grad_loss=grad_loss, grad_lse=grad_lse, reduction=ctx.reduction, count=ctx.count, chunk_rows=ctx.chunk_rows,
    )
    return _backward_to(ctx, logits, write), None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """CE over vocab-sharded logits: this rank's slice ``logits`` [N, V_local] of the [N, V] logits,
    columns ``vocab_start ... vocab_start + V_local`` of the vocabulary, against the full ``targets``
    [N] (the same on every rank of ``group``, as is everything but the logits).

    ``apply(logits, probe, targets, vocab_start, group, ignore_index, reduction, chunk_rows, mode,
    deferred)``, otherwise as :class:`ChunkedCrossEntropy`. Forward: the row max (all-reduced MAX),
    then chunk by chunk in fp32 the sum of ``exp(x - max)`` over the slice, and the target logit from
    the rank whose slice holds it (0 elsewhere), both all-reduced (SUM) together: two collectives of
    [N] and [2, N] fp32, whatever the chunking. The loss and logsumexp are the same on every rank.
    Backward: no communication; ``(softmax - onehot) * grad_output`` of this slice, written over it
    per ``mode``. ``deferred``'s owners may be DTensors (the caller's vocab-sharded logits): their
    version counter is bumped too once their local shard has been written over.
    """

    @staticmethod
    def forward(ctx, logits, probe, targets, vocab_start, group, ignore_index, reduction, chunk_rows, mode, deferred):
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
                    stats[0, chunk] = _ChunkKernels.sum_exp(logits[chunk], shift[chunk].unsqueeze(1))
                target_logit = logits.gather(1, index.unsqueeze(1)).squeeze(1).float()
                stats[1] = torch.where(hit, target_logit, 0.0)
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
            lse = stats[0].log_().add_(shift)
            per_row = torch.where(valid, lse - stats[1], 0.0)
        count = valid.sum()
        loss = _reduce(per_row, count, reduction)
        ctx.save_for_backward(logits, lse, targets)
        ctx.set_materialize_grads(False)
        ctx.ignore_index, ctx.reduction, ctx.chunk_rows = ignore_index, reduction, chunk_rows
        ctx.vocab_start, ctx.count, ctx.mode, ctx.deferred = vocab_start, count, mode, deferred
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        ctx.create_graph = torch.is_grad_enabled()
        return _vocab_parallel_backward(ctx, grad_loss, grad_lse) + (None,) * 8


@once_differentiable
def _vocab_parallel_backward(ctx, grad_loss, grad_lse):
    if grad_loss is None and grad_lse is None:
        return None, None
    logits, lse, targets = ctx.saved_tensors  # checks nobody wrote over the logits since forward
    valid, hit, index = _vocab_slice_targets(targets, ctx.ignore_index, ctx.vocab_start, logits.shape[1])
    write = functools.partial(
        _logits_gradient, lse=lse, valid=valid, hit=hit, index=index, grad_loss=grad_loss, grad_lse=grad_lse,
        reduction=ctx.reduction, count=ctx.count, chunk_rows=ctx.chunk_rows,
    )
    return _backward_to(ctx, logits, write), None


def _backward_to(ctx, logits: torch.Tensor, write: Callable) -> torch.Tensor:
    """The gradient the kernel's backward returns for ``logits``, per ``ctx.mode``: a fresh buffer,
    the logits' own (written now), or, in a plain backward, the placeholder while ``ctx.deferred``'s
    hook writes it later."""
    if ctx.mode == "copy":
        return write(logits, torch.empty_like(logits))
    deferred = ctx.deferred
    if deferred is not None and not ctx.create_graph and _plain_backward(ctx.next_functions[1][0]):
        deferred.write = lambda values, extra: write(values, values, extra=extra)
        return deferred.placeholder(logits)
    write(logits, logits)
    if deferred is not None:
        _mark_consumed(deferred.owners, deferred.bump)
    return logits


def _plain_backward(probe_node) -> bool:
    """Whether the running backward executes every node of the graph and hands no gradient to its
    caller before the hooks ran (a plain ``backward()``): ``torch.autograd.grad`` and
    ``backward(inputs=...)`` skip the probe's node, which only this call's graph holds."""
    if probe_node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(probe_node))
    except Exception:  # an engine without it: write at once, as before
        return False


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


def _logits_gradient(
    values: torch.Tensor, out: torch.Tensor, *, lse: torch.Tensor, valid: torch.Tensor, hit: torch.Tensor,
    index: torch.Tensor, grad_loss: torch.Tensor | None, grad_lse: torch.Tensor | None, reduction: str,
    count: torch.Tensor, chunk_rows: int, extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient w.r.t. logits ``values`` [N, V] (all of the vocabulary or one slice of it) into
    ``out`` (``values`` itself: in place): ``softmax * (g + g_lse) - onehot * g`` (``g`` the loss's
    output gradient per row, ``g_lse`` the logsumexp's), chunk by chunk in fp32, plus ``extra`` [N, V]
    (the other consumers' gradient) when given. ``hit``: rows whose target column ``index`` is in
    ``values``; rows not ``valid`` (ignored) get no loss gradient."""
    n = values.shape[0]
    if grad_loss is None:
        scale = torch.zeros(n, device=values.device)
    else:
        scale = grad_loss.float().expand(n) if reduction != "none" else grad_loss.float().reshape(n)
        if reduction == "mean":
            scale = scale / count.clamp_min(1)
    scale = torch.where(valid, scale, 0.0).unsqueeze(1)
    minus_onehot = hit.to(torch.float32).neg_().unsqueeze(1)
    softmax_scale = None if grad_lse is None else scale + grad_lse.float().reshape(n, 1)
    if softmax_scale is not None:
        minus_onehot = minus_onehot.mul_(scale)
    index = index.unsqueeze(1)
    if values.shape[1] == 0:
        return out
    direct = out.dtype == torch.float32  # fp32: compute straight into the gradient's rows
    compiled = _ChunkKernels.gradient
    with torch.autocast(values.device.type, enabled=False):
        for start in range(0, n, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            rows = values[chunk]
            if compiled is not None:  # one fused kernel per chunk, then one copy into the gradient's rows
                out[chunk].copy_(compiled(
                    rows, lse[chunk], scale[chunk], None if softmax_scale is None else softmax_scale[chunk],
                    index[chunk], minus_onehot[chunk], None if extra is None else extra[chunk]))
                continue
            if direct:
                probs = torch.sub(rows, lse[chunk].unsqueeze(1), out=out[chunk])
            else:
                probs = rows.to(torch.float32, copy=True).sub_(lse[chunk].unsqueeze(1))
            probs.exp_()
            if softmax_scale is None:
                probs.scatter_add_(1, index[chunk], minus_onehot[chunk]).mul_(scale[chunk])
            else:
                probs.mul_(softmax_scale[chunk]).scatter_add_(1, index[chunk], minus_onehot[chunk])
            if extra is not None:
                probs.add_(extra[chunk])
            if not direct:
                out[chunk].copy_(probs)
            del probs
    return out


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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s data lives (a DTensor's: its local shard's)."""
    return _local(tensor).untyped_storage().data_ptr()


def _plan(logits: torch.Tensor, rows: torch.Tensor, inplace_backward: bool) -> tuple[str, _Deferred | None]:
    """How the backward treats the gradient of ``logits`` (the caller's tensor, a DTensor's local
    shard being ``rows`` [N, V_local] of it): ``("copy", None)``, ``("private", None)`` or
    ``("inplace", deferred)``, the hook that will write it already registered (see the module
    docstring)."""
    _check_not_consumed(logits)
    owner = logits._base if logits._base is not None else logits
    if not (inplace_backward and torch.is_grad_enabled() and logits.requires_grad
            and owner.grad_fn is not None and not _producer_saved(owner)):
        return "copy", None
    local = _local(logits)
    if rows.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
        return "private", None  # reshape had to copy: that copy is ours
    key = (rows.device, rows.untyped_storage().data_ptr())
    if key in _PENDING:
        return "copy", None  # another call's write over this buffer is still to come
    target, view_guard = _hook_target(logits, owner)
    owners = tuple(weakref.ref(t) for t in {id(logits): logits, id(owner): owner}.values())
    deferred = _Deferred(target, rows.shape, owners, bump=isinstance(logits, DTensor), view_guard=view_guard)
    if deferred.values.data_ptr() != rows.data_ptr() or deferred.values.stride() != rows.stride():
        return "copy", None  # (not expected: the same elements in the same order)
    _register_first(target, deferred.hook)
    _PENDING[key] = deferred
    return "inplace", deferred


def _hook_target(logits: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """Which tensor's gradient hook writes the logits' gradient: the logits, or, when they are a plain
    view holding all of their base's elements in order (and carry no hook of the caller's yet), the
    base, with what the hook checks on the view."""
    if logits is base or isinstance(logits, DTensor):
        return logits, None
    node = logits.grad_fn
    if (type(node).__name__ in _VIEW_NODES and node.next_functions[0][0] is base.grad_fn
            and base.is_contiguous() and base.numel() == logits.numel() and base.data_ptr() == logits.data_ptr()
            and not logits._backward_hooks and not logits.retains_grad):
        logits.register_hook(_no_hook)  # makes the view's hook dict, so that hooks added later are seen
        return base, (weakref.ref(logits), logits._backward_hooks)
    return logits, None


def _no_hook(grad: torch.Tensor) -> None:
    return None


def _register_first(tensor: torch.Tensor, hook: Callable) -> None:
    """``tensor.register_hook(hook)``, moved before the hooks already there (autograd calls a tensor's
    hooks in the order of its hook dict), so that every other hook sees the complete gradient."""
    handle = tensor.register_hook(hook)
    hooks = tensor._backward_hooks
    others = [(key, value) for key, value in hooks.items() if key != handle.id]
    if others:
        hooks.clear()
        hooks[handle.id] = hook
        hooks.update(others)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = logits.shape[-1]
    if isinstance(targets, DTensor):
        targets = targets.full_tensor()
    if targets.numel() != logits.numel() // max(vocab, 1):
        raise ValueError(f"cross_entropy: targets {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits.shape)} without their vocab dim")
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
    flat = local.reshape(targets.numel(), local_vocab)
    mode, deferred = _plan(logits, flat, inplace_backward)
    return VocabParallelCrossEntropy.apply(
        flat, _probe(flat) if mode == "inplace" else None, targets.reshape(-1).to(local.device), offset[-1],
        mesh.get_group(), ignore_index, reduction, rows, mode, deferred,
    )


def _probe(like: torch.Tensor) -> torch.Tensor:
    """A leaf only this call's graph holds (no memory): see :func:`_plain_backward`."""
    return torch.empty(0, device=like.device, requires_grad=True)


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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """CE over the last dim of ``logits`` [..., vocab] against ``targets`` [...]; ``sum`` by default so
    callers normalise by the token count of the whole optimizer step, not of one micro-batch.

    Computed in fp32 whatever the logits' dtype; the loss is fp32. ``mean`` averages over the
    non-ignored targets (0 when all are ignored); ``none`` gives the [N] per-position losses of the
    flattened positions (0 at ignored ones). The gradient has the logits' dtype.

    ``return_lse=True`` returns ``(loss, lse)``: ``lse`` the logsumexp of every position's logits,
    fp32, shaped as ``targets`` (ignored positions included), differentiable at no extra cost (a
    z-loss: ``weight * (lse[targets != ignore_index] ** 2).sum() / count``).

    **The logits are consumed**: unless ``inplace_backward=False`` (or the guards in the module
    docstring apply), the backward writes their gradient over them; read them before the backward.
    Other losses on the same logits are fine (see the module docstring). ``chunk_rows`` overrides the
    rows upcast at a time (default :func:`default_chunk_rows`, of this rank's vocab slice for
    vocab-parallel logits).

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
            loss, lse = _vocab_parallel_cross_entropy(logits, targets, ignore_index, reduction, inplace_backward,
                                                      chunk_rows)
            return (loss, lse.view(targets.shape)) if return_lse else loss
        # Any other layout: torch's DTensor cross-entropy (for logits sharded on the vocabulary
        # otherwise, under the loss_parallel context); the reduced loss comes back as a plain tensor.
        flat = logits.reshape(-1, vocab).float()
        loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index, reduction=reduction)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        if not return_lse:
            return loss
        lse = flat.logsumexp(-1)
        return loss, (lse.full_tensor() if isinstance(lse, DTensor) else lse).view(targets.shape)
    if targets.numel() != logits.numel() // max(vocab, 1):
        raise ValueError(f"cross_entropy: targets {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits.shape)} without their vocab dim")
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(vocab)
    if rows < 1:
        raise ValueError(f"cross_entropy: chunk_rows must be >= 1, got {rows}")
    flat = logits.reshape(-1, vocab)
    mode, deferred = _plan(logits, flat, inplace_backward)
    loss, lse = ChunkedCrossEntropy.apply(
        flat, _probe(flat) if mode == "inplace" else None, targets.reshape(-1), ignore_index, reduction, rows,
        mode, deferred,
    )
    return (loss, lse.view(targets.shape)) if return_lse else loss
