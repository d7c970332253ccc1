"""Manifold-constrained hyper-connections (mHC): DeepSeek-V4's residual stream, in plain PyTorch.

Why: a plain residual adds every block's output to one stream; hyper-connections keep ``n``
parallel streams ``[batch, seq, n, d_model]`` and learn, per token, how to collapse them into a
block's input (``pre``), how to spread the block's output back over them (``post``) and how the
streams mix among themselves (``comb``). Unconstrained mixing can amplify the residual from layer to
layer; mHC projects ``comb`` onto doubly stochastic matrices (rows and columns summing to 1) with
Sinkhorn-Knopp iterations, so the mixing is an average, never an amplification (DeepSeek-V4,
sec. 2.2). The three weights come from one linear map of the RMS-normalised streams and are
computed in fp32 whatever the activation dtype, as DeepSeek keeps them.

Semantics follow transformers 5.24's ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``
(the parity reference, ``tests/unit/models/test_hyper_connections.py``): ``streams`` mixed as
``comb^T @ streams``, ``post`` in (0, 2), ``pre`` in (eps, 1 + eps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` (fp32) over its last dim divided by its root mean square; no weight."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def sinkhorn(logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """``softmax(logits)`` over the last dim (+ ``eps``) alternately normalised over columns and
    rows, ``iterations`` column passes in all: close to doubly stochastic for a handful."""
    matrix = torch.softmax(logits, dim=-1) + eps
    matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
        matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    return matrix


class HyperConnection(nn.Module):
    """The mHC around one sub-block (attention or the MLP): ``forward(streams, sublayer)`` returns
    ``post * sublayer(collapse(streams)) + comb^T @ streams``, shapes ``[batch, seq, n, d_model]``."""

    def __init__(self, d_model: int, n_streams: int, sinkhorn_iters: int, eps: float = 1e-6,
                 norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.n_streams, self.sinkhorn_iters, self.eps, self.norm_eps = n_streams, sinkhorn_iters, eps, norm_eps
        n = n_streams
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * d_model))
        """One map from the flattened streams to the ``pre`` (n), ``post`` (n) and ``comb`` (n x n) logits."""
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))
        """The ``pre``, ``post`` and ``comb`` logits' scales."""
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.fn, std=std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [.., n], post [.., n], comb [.., n, n]) in fp32 for ``streams`` [.., n, d_model]."""
        n = self.n_streams
        flat = _rms_normalised(streams.flatten(-2).float(), self.norm_eps)
        logits = F.linear(flat, self.fn.float())
        pre_logits, post_logits, comb_logits = logits.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.float().split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_logits * pre_scale + pre_base) + self.eps
        post = 2 * torch.sigmoid(post_logits * post_scale + post_base)
        comb_logits = comb_logits.unflatten(-1, (n, n)) * comb_scale + comb_base.view(n, n)
        return pre, post, sinkhorn(comb_logits, self.sinkhorn_iters, self.eps)

    def forward(self, streams: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        dtype = streams.dtype
        pre, post, comb = self.weights(streams)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(dtype)
        out = sublayer(collapsed)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """The last collapse of the streams into one hidden state, before the final norm and the head."""

    def __init__(self, d_model: int, n_streams: int, eps: float = 1e-6, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty(n_streams, n_streams * d_model))
        self.base = nn.Parameter(torch.zeros(n_streams))
        self.scale = nn.Parameter(torch.ones(1))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.fn, std=std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = _rms_normalised(streams.flatten(-2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def expand_streams(hidden: torch.Tensor, n_streams: int) -> torch.Tensor:
    """The embedding ``[batch, seq, d_model]`` copied into ``n_streams`` residual streams."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], n_streams, hidden.shape[-1]).contiguous()
