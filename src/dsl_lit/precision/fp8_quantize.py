"""FP8 quantisation of a 2-D operand in scale groups (tiles, blocks, rows or the whole tensor), with
torchao's arithmetic, so that the reference path and torchao give the same bits (see ``fp8.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX: dict[torch.dtype, float] = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344
AMAX_EPS = 1e-12
"""Floor of a tile's amax, so an all-zero tile gets a finite scale (its values stay 0)."""


@dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantised. The operand is seen as ``[rows, k]`` with ``k`` the
    contraction dim; ``block = (rows, k)`` elements share one scale, ``0`` meaning the whole dim
    (``(1, 128)``: 1x128 tiles; ``(128, 128)``: blocks; ``(1, 0)``: rowwise; ``(0, 0)``: tensorwise)."""

    block: tuple[int, int]
    dtype: torch.dtype = E4M3
    pow2_scales: bool = False


# -- quantisation ------------------------------------------------------------------------------------


def _tiles(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """2-D ``t`` in fp32 as a [row groups, br, col groups, bc] view, zero-padded to whole groups
    (the zeros do not change any group's amax and are cropped afterwards)."""
    rows, cols = t.shape
    br, bc = block[0] or max(rows, 1), block[1] or max(cols, 1)
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    t32 = t.to(torch.float32)
    if nr * br != rows or nc * bc != cols:
        t32 = F.pad(t32, (0, nc * bc - cols, 0, nr * br - rows))
    return t32.contiguous().view(nr, br, nc, bc)


def _untile(tiles: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    nr, br, nc, bc = tiles.shape
    return tiles.view(nr * br, nc * bc)[: shape[0], : shape[1]]


def _quantize_tiles(tiles: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    nr, br, nc, bc = tiles.shape
    fmax = FP8_MAX[spec.dtype]
    # amax over dims (1, 3) of the 4-D view is a slow strided reduction on CPU; putting each
    # tile's elements last first is ~100x faster (it copies only for multi-row tiles)
    amax = tiles.permute(0, 2, 1, 3).reshape(nr, nc, br * bc).abs().amax(dim=-1)
    # torchao's formula, so that both give the same bits: the multiplier fp8_max / amax is
    # computed in float64 and rounded once to fp32, values are multiplied by it, and the
    # dequantisation scale is its fp32 reciprocal. (Dividing by an fp32 amax / fp8_max instead
    # changes ~2 FP8 values in 10^7, and the last bit of one scale in four.)
    multiplier = (fmax / amax.double().clamp_min(AMAX_EPS)).float()
    if spec.pow2_scales:  # rounded down: amax * multiplier stays <= fp8_max
        multiplier = torch.exp2(torch.floor(torch.log2(multiplier)))
    q = (tiles * multiplier[:, None, :, None]).clamp_(-fmax, fmax).to(spec.dtype)
    return q, multiplier.reciprocal()


def quantize_fp8(t: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``t`` -> (FP8 values of ``t``'s shape, fp32 scales [ceil(rows/br), ceil(k/bk)]) with
    ``t ~= q * scale``: per group, multiplier = fp32(fp8_max / float64(amax)) (rounded down to a
    power of two if the spec asks), ``t * multiplier`` clamped to +-fp8_max and cast
    (round-to-nearest-even), scale = fp32(1 / multiplier)."""
    q, scale = _quantize_tiles(_tiles(t, spec.block), spec)
    return _untile(q, t.shape), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`, in fp32."""
    return _untile(_tiles(q, block) * scale[:, None, :, None], q.shape)


def fake_quantize_fp8(t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``t`` as the FP8 GEMM sees it (quantised, then dequantised to fp32)."""
    q, scale = _quantize_tiles(_tiles(t, spec.block), spec)
    return _untile(q.to(torch.float32) * scale[:, None, :, None], t.shape)
