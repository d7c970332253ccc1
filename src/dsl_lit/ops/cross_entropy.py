"""Token-level cross-entropy: the single entry point every objective's loss goes through.

Logits of any dtype are upcast to fp32 inside the loss. (A later change replaces the body with a
chunked in-place kernel; callers do not change.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "sum"
) -> torch.Tensor:
    """CE over the last dim of ``logits`` [..., vocab] against ``targets`` [...]; ``sum`` by default so
    callers normalise by the token count of the whole optimizer step, not of one micro-batch."""
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
        ignore_index=ignore_index, reduction=reduction,
    )
    # Vocab-parallel logits (tensor parallelism): a DTensor sharded on the vocabulary; the loss is
    # computed without gathering them, under torch's loss_parallel context (forward and backward),
    # which the strategy opens. The reduced loss is replicated: hand back a plain tensor.
    return loss.to_local() if isinstance(loss, DTensor) else loss
