"""Log-probabilities of given tokens under a model's logits, through our cross-entropy kernel.

Why not ``log_softmax(logits).gather``: that materialises an fp32 [tokens, vocab] tensor; the
chunked cross-entropy (``reduction="none"``) gives ``-log p(target)`` per position without it, and
also handles vocab-parallel (tensor-parallel) logits. Ignored positions (label -100) get 0.
"""

from __future__ import annotations

import torch

from dsl_lit.ops import cross_entropy


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[batch, seq] fp32 ``log softmax(logits / temperature)[label]``; 0 where ``labels == -100``.

    The logits are consumed by the backward (see :func:`dsl_lit.ops.cross_entropy`)."""
    if temperature != 1.0:
        logits = logits / temperature
    return -cross_entropy(logits, labels, reduction="none").view(labels.shape)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """[batch] sum (or with ``average`` the mean) of the log-probabilities of each row's labelled tokens."""
    per_token = token_logps(logits, labels)
    total = per_token.sum(dim=-1)
    if not average:
        return total
    return total / (labels != -100).sum(dim=-1).clamp_min(1)
