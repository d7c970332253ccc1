"""Building blocks shared by every DeepSeek decoder: RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import math
from typing import Any

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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(scaling: dict[str, Any] | None) -> float:
    """Multiplier for the softmax scale under YaRN (DeepSeek-V2/V3 apply mscale_all_dim squared)."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def rope_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and the cos/sin multiplier, plain or YaRN-scaled.

    YaRN keeps high frequencies (fewer than ``beta_fast`` rotations over the original context)
    unscaled, divides low ones (fewer than ``beta_slow`` rotations) by
    ``factor``, and ramps linearly in between; the same recipe as DeepSeek-V2/V3 and HF.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / theta**exponents
    if not scaling:
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    original = float(scaling["original_max_seq_len"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    if mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_seq_len, dim] (angles repeated twice, HF's layout).

    Plain RoPE for DeepSeek LLM; with ``scaling`` the YaRN-extended tables of DeepSeek-V2/V3. The
    tables are looked up by offset (training, cached decoding) or by explicit per-token positions
    (left-padded batches).
    """

    def __init__(
        self, dim: int, max_seq_len: int, theta: float = 10000.0, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.dim = dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = dict(scaling) if scaling else None
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, attention_factor = rope_frequencies(self.dim, self.theta, self.scaling)
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq.to(device))
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * attention_factor, angles.sin() * attention_factor

    def reset_parameters(self) -> None:
        """Recompute the tables (needed after building on the meta device and materialising)."""
        cos, sin = self._tables(self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(
        self, seq_len: int, offset: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for positions ``offset .. offset+seq_len-1`` ([seq, dim]) or for ``positions``
        [batch, seq] ([batch, seq, dim])."""
        if positions is not None:
            return self.cos[positions], self.sin[positions]
        if offset + seq_len > self.max_seq_len:
            raise ValueError(f"position {offset + seq_len - 1} is beyond max_seq_len={self.max_seq_len}")
        return self.cos[offset : offset + seq_len], self.sin[offset : offset + seq_len]


def _broadcastable(table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[seq, dim] -> [seq, 1, dim]; [batch, seq, dim] -> [batch, seq, 1, dim] (a heads axis)."""
    return table.unsqueeze(-2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` [batch, seq, heads, dim] by position.

    ``interleaved=False`` rotates the two halves of the head (Llama, DeepSeek LLM);
    ``interleaved=True`` rotates adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek-V2/V3) and returns
    the rotated pairs de-interleaved, [evens | odds], as HF does: q and k get the same permutation,
    so their dot products are those of the interleaved rotation.
    """
    cos, sin = _broadcastable(cos, x.dtype), _broadcastable(sin, x.dtype)
    half = x.shape[-1] // 2
    if interleaved:
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def gated_silu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit`` (DeepSeek-V4's ``swiglu_limit``) the gate clamped from
    above and ``up`` to [-limit, limit] first, which bounds what one expert can add to the residual."""
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """Gated feed-forward: w2(silu(w1 x) * w3 x) (pre-activations clamped to ``limit`` if given)."""

    def __init__(self, dim: int, hidden: int, limit: float | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(gated_silu(self.w1(x), self.w3(x), self.limit))
