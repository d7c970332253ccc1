"""DeepSeek's block-FP8 checkpoint format (V3's release, and V4's for all but its routed experts).

``config.json`` carries ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}``, DeepSeek-V4's with
``"scale_fmt": "ue8m0"`` too; each quantised weight ``W`` [out, in] is stored as ``float8_e4m3fn``
next to ``W_scale_inv``, one value per 128x128 block: [ceil(out/128), ceil(in/128)]; edge blocks
may be ragged, e.g. the 576 rows of ``kv_a_proj_with_mqa``. The scales are fp32 (V3) or, with
``scale_fmt`` "ue8m0" (V4), ``float8_e8m0fnu`` powers of two. Reading and the shared mechanics:
:mod:`dsl_lit.hf.block_scaled`. Which weights a layout quantises is the family adapter's
(:meth:`~dsl_lit.models.common.hf_adapter.HFAdapter.quantizes_fp8`).

Writing quantises each block with amax scaling (:func:`dsl_lit.precision.fp8.quantize_fp8`:
``scale_inv`` = 1 / fp32(448 / amax), about amax / 448, so the block's largest value maps to 448;
for "ue8m0" that scale rounded up to a power of two, as transformers' ``Fp8Quantize`` and
DeepSeek's kernels round it, so the largest value maps into (224, 448]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from data_contract.errors import ConfigError
from dsl_lit.hf.block_scaled import BlockScaled
from dsl_lit.precision.fp8_quantize import E4M3, QuantSpec, dequantize_fp8, quantize_fp8

QUANT_METHOD = "fp8"
DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class BlockFP8(BlockScaled):
    """The block-FP8 format of one checkpoint: the block its scales cover and how they are stored."""

    block: tuple[int, int] = DEFAULT_BLOCK

    kind: ClassVar[str] = "FP8"

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> BlockFP8 | None:
        """The format ``config.json`` declares (None without ``quantization_config``); ConfigError
        naming the field for a quantisation this reader does not know."""
        quant = hf_config.get("quantization_config")
        if not quant:
            return None
        where = "config.json quantization_config"
        if not isinstance(quant, Mapping):
            raise ConfigError(f"{where} must be an object, got {quant!r}")
        method = quant.get("quant_method")
        if method != QUANT_METHOD:
            raise ConfigError(
                f"{where}.quant_method={method!r} is not supported: only DeepSeek-V3's block FP8 "
                f"(quant_method {QUANT_METHOD!r}, fmt 'e4m3', weight_block_size) can be read; dequantise "
                "other formats first"
            )
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{where}.fmt={quant['fmt']!r} is not supported; DeepSeek-V3's weights are e4m3")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"{where}.activation_scheme={quant['activation_scheme']!r} is not supported: only the weights' "
                "block scales are read ('dynamic', as DeepSeek-V3 releases them)"
            )
        block = quant.get("weight_block_size")
        if (
            not isinstance(block, Sequence)
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise ConfigError(
                f"{where}.weight_block_size={block!r} must be two positive integers (DeepSeek-V3: [128, 128])"
            )
        return cls((block[0], block[1]), quant.get("scale_fmt") or "float")  # ConfigError if unknown

    def hf_config(self) -> dict[str, Any]:
        """The ``quantization_config`` entry of config.json, as DeepSeek's releases write it
        (``scale_fmt`` only when not V3's fp32)."""
        out: dict[str, Any] = {
            "quant_method": QUANT_METHOD,
            "fmt": "e4m3",
            "weight_block_size": list(self.block),
            "activation_scheme": "dynamic",
        }
        if self.scale_fmt != "float":
            out["scale_fmt"] = self.scale_fmt
        return out

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8(weight, QuantSpec(self.block, E4M3, pow2_scales=self.pow2))

    def dequantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8(values, scales, self.block)
