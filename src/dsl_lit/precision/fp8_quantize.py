"""FP8 quantisation of a 2-D operand in scale groups (tiles, blocks, rows or the whole tensor), with
torchao's arithmetic, so that the reference path and torchao give the same bits (see ``fp8.py``);
and FP4 (e2m1) in the same groups with power-of-two scales, the format of DeepSeek-V4's released
routed experts (:mod:`dsl_lit.hf.fp4_rows` stores it)."""

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


def _multipliers(tiles: torch.Tensor, fmax: float, pow2: bool) -> torch.Tensor:
    """Per group of the [nr, br, nc, bc] ``tiles``, the fp32 factor mapping its amax to ``fmax``
    ([nr, nc]); rounded down to a power of two with ``pow2`` (the scale, its reciprocal, rounded up)."""
    nr, br, nc, bc = tiles.shape
    # amax over dims (1, 3) of the 4-D view is a slow strided reduction on CPU; putting each
    # tile's elements last first is ~100x faster (it copies only for multi-row tiles)
    amax = tiles.permute(0, 2, 1, 3).reshape(nr, nc, br * bc).abs().amax(dim=-1)
    # torchao's formula, so that both give the same bits: the multiplier fp8_max / amax is
    # computed in float64 and rounded once to fp32, values are multiplied by it, and the
    # dequantisation scale is its fp32 reciprocal. (Dividing by an fp32 amax / fp8_max instead
    # changes ~2 FP8 values in 10^7, and the last bit of one scale in four.)
    multiplier = (fmax / amax.double().clamp_min(AMAX_EPS)).float()
    if pow2:  # rounded down: amax * multiplier stays <= fmax
        multiplier = torch.exp2(torch.floor(torch.log2(multiplier)))
    return multiplier


def _quantize_tiles(tiles: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = FP8_MAX[spec.dtype]
    multiplier = _multipliers(tiles, fmax, spec.pow2_scales)
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


# -- FP4 (e2m1) ----------------------------------------------------------------------------------

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each of the 16 e2m1 codes (1 sign bit, the high one; 2 exponent bits, bias 1; 1
mantissa bit; no inf or NaN): OCP's MX FP4, DeepSeek's ``FP4_TABLE``, torch's ``float4_e2m1fn``."""
E2M1_MAX = 6.0
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Halfway between consecutive magnitudes (codes 0-7)."""
_E2M1_TIES_UP = (0.75, 1.75, 3.5)
"""Midpoints whose upper neighbour has the even code (2, 4, 6): a value on one rounds up."""


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Values -> e2m1 codes (uint8, 0-15): round to nearest, ties to the even code (IEEE's rule, a
    hardware cast's), saturating at +-6; the sign bit kept for values that round to 0."""
    mag = x.float().abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, device=x.device)
    code = torch.bucketize(mag, mids) + torch.isin(mag, torch.tensor(_E2M1_TIES_UP, device=x.device))
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0-15, any integer dtype) -> their fp32 values."""
    return torch.tensor(E2M1_VALUES, device=codes.device)[codes.long()]


def quantize_e2m1(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``t`` -> (e2m1 codes of ``t``'s shape, fp32 power-of-two scales per ``block`` group) with
    ``t ~= value(code) * scale``: the scale is the smallest power of two that fits the group's amax
    in +-6 (as :func:`quantize_fp8` with ``pow2_scales``), each value rounded to the nearest code."""
    tiles = _tiles(t, block)
    multiplier = _multipliers(tiles, E2M1_MAX, pow2=True)
    codes = encode_e2m1(tiles * multiplier[:, None, :, None])  # saturating: no clamp needed
    return _untile(codes, t.shape), multiplier.reciprocal()


def dequantize_e2m1(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`quantize_e2m1`, in fp32."""
    return dequantize_fp8(decode_e2m1(codes), scale, block)
