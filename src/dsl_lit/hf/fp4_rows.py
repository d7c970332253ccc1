"""DeepSeek-V4's FP4 routed experts, as its release stores them.

``config.json`` says ``"expert_dtype": "fp4"`` (top-level in V4's release, inside
``quantization_config`` in V4.1's; transformers folds the first into the second). Each routed
expert's weight ``W`` [out, in] is then stored as ``int8`` [out, in/2], two e2m1 codes a byte (the
even element in the low nibble, the odd one in the high nibble: torch's ``float4_e2m1fn_x2``),
next to ``W_scale_inv`` [out, in/32], one scale per row per 32 input elements, stored as the
checkpoint's ``scale_fmt`` says (``float8_e8m0fnu`` powers of two in the release). The shared
experts and attention projections stay block FP8 (:mod:`dsl_lit.hf.fp8_blocks`). Reading a region:
:mod:`dsl_lit.hf.block_scaled` (a shard's columns start on a 32-column group, 16 bytes).

Writing rounds each value to the nearest e2m1 code after scaling its group's amax into (3, 6] by a
power of two (:func:`dsl_lit.precision.fp8_quantize.quantize_e2m1`), as DeepSeek's
``fp4_act_quant`` and transformers' ``Fp8Quantize`` choose the scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from data_contract.errors import ConfigError
from dsl_lit.hf.block_scaled import BlockScaled
from dsl_lit.precision.fp8_quantize import dequantize_e2m1, quantize_e2m1

GROUP = 32
EXPERT_DTYPES = ("fp8", "fp4")


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., 2n] -> int8 [..., n]: element 2j in the low nibble of byte j, 2j+1 in the high."""
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: int8 [..., n] -> codes (uint8) [..., 2n]."""
    u8 = packed.view(torch.uint8)
    return torch.stack([u8 & 0xF, u8 >> 4], dim=-1).flatten(-2)


def expert_dtype(hf_config: Mapping[str, Any]) -> str:
    """config.json's ``expert_dtype`` ("fp8" when absent), from ``quantization_config`` or the top
    level; ConfigError naming the field when unknown or when the two disagree."""
    quant = hf_config.get("quantization_config")
    inner = quant.get("expert_dtype") if isinstance(quant, Mapping) else None
    outer = hf_config.get("expert_dtype")
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(f"config.json expert_dtype={outer!r} and quantization_config.expert_dtype={inner!r} "
                          "disagree; keep one of them")
    value = inner if inner is not None else outer
    if value is None:
        return "fp8"
    if value not in EXPERT_DTYPES:
        where = "quantization_config.expert_dtype" if inner is not None else "expert_dtype"
        raise ConfigError(f"config.json {where}={value!r} is not supported; use 'fp4' (DeepSeek-V4's FP4 routed "
                          "experts) or 'fp8' (block FP8 like the other projections)")
    return str(value)


@dataclass(frozen=True)
class FP4Rows(BlockScaled):
    """e2m1 values packed two a byte, one scale per row per :data:`GROUP` input elements."""

    block: tuple[int, int] = (1, GROUP)
    scale_fmt: str = "ue8m0"

    kind: ClassVar[str] = "FP4"
    values_per_element: ClassVar[int] = 2

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if weight.shape[1] % self.block[1]:
            raise ConfigError(f"an FP4 weight of shape {tuple(weight.shape)} cannot be written: its input dim must be a "
                              f"multiple of {self.block[1]} (one scale per {self.block[1]} values); save with "
                              "fp8=False or choose a width that is")
        codes, scales = quantize_e2m1(weight, self.block)  # powers of two whatever scale_fmt stores them as
        return pack_e2m1(codes), scales

    def dequantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_e2m1(unpack_e2m1(values), scales, self.block)
