"""Building blocks shared by every DeepSeek decoder: RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the activation dtype (as the papers keep it)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return normed * self.weight.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for RoPE in the "rotate half" layout that Hugging Face Llama uses.

    Using HF's layout means checkpoints convert without permuting q/k weights.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
        )
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def reset_parameters(self) -> None:
        """Recompute the tables (needed after building on the meta device and materialising)."""
        cos, sin = self._tables(self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, seq_len: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[offset : offset + seq_len], self.sin[offset : offset + seq_len]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [batch, seq, heads, head_dim] by position; cos/sin are [seq, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """Gated feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
