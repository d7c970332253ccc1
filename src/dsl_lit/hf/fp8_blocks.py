"""DeepSeek-V3's block-FP8 checkpoint format, as the hub release stores it.

``config.json`` carries ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}``; each quantised weight ``W``
[out, in] is stored as ``float8_e4m3fn`` next to ``W_scale_inv`` (fp32, one value per 128x128
block: [ceil(out/128), ceil(in/128)]; edge blocks may be ragged, e.g. the 576 rows of
``kv_a_proj_with_mqa``). A weight's value is its FP8 value times its block's ``scale_inv``,
multiplied in fp32 (DeepSeek's ``weight_dequant``, transformers' ``Fp8Dequantize``), then cast to
the dtype asked for. Which weights a layout quantises is the family adapter's
(:meth:`~dsl_lit.models.common.hf_adapter.HFAdapter.quantizes_fp8`).

Reading works on regions: a process holding a tensor shard dequantises only the blocks that cover
it (:meth:`BlockFP8.read_region`). Writing quantises each block with amax scaling
(:func:`dsl_lit.precision.fp8.quantize_fp8`: ``scale_inv`` = 1 / fp32(448 / amax), about
amax / 448, so the block's largest value maps to 448).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from data_contract.errors import ConfigError
from dsl_lit.precision.fp8_quantize import E4M3, QuantSpec, dequantize_fp8, quantize_fp8

SCALE_SUFFIX = "_scale_inv"
"""``<weight name><SCALE_SUFFIX>`` holds the weight's per-block inverse scales."""
QUANT_METHOD = "fp8"
DEFAULT_BLOCK = (128, 128)

Region = tuple[slice, ...]
ReadRegion = Callable[[Region], torch.Tensor]
"""Reads one region (a slice per dim) of a stored tensor."""


@dataclass(frozen=True)
class BlockFP8:
    """The block-FP8 format of one checkpoint: the block shape its scales cover."""

    block: tuple[int, int] = DEFAULT_BLOCK

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
        return cls((block[0], block[1]))

    def hf_config(self) -> dict[str, Any]:
        """The ``quantization_config`` entry of config.json, as the DeepSeek-V3 release writes it."""
        return {
            "quant_method": QUANT_METHOD,
            "fmt": "e4m3",
            "weight_block_size": list(self.block),
            "activation_scheme": "dynamic",
        }

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """Shape of the ``_scale_inv`` tensor of a weight of ``shape``."""
        return (math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1]))

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D ``weight`` -> (float8_e4m3fn values, fp32 ``scale_inv`` per block)."""
        if weight.ndim != 2:
            raise ValueError(f"block FP8 quantises 2-D weights, got shape {tuple(weight.shape)}")
        return quantize_fp8(weight, QuantSpec(self.block, E4M3))

    def read_region(
        self,
        read_weight: ReadRegion,
        read_scale: ReadRegion,
        shape: Sequence[int],
        offsets: Sequence[int],
        size: Sequence[int],
    ) -> torch.Tensor:
        """Rows ``[offsets[0], +size[0])`` x cols ``[offsets[1], +size[1])`` of a stored weight of
        ``shape``, dequantised (fp32): reads the FP8 values and scales of the blocks that cover the
        region only, dequantises them and crops."""
        (rows, cols), (br, bc) = shape, self.block
        r0, c0 = offsets[0] - offsets[0] % br, offsets[1] - offsets[1] % bc  # block-aligned region
        r1 = min(rows, math.ceil((offsets[0] + size[0]) / br) * br)
        c1 = min(cols, math.ceil((offsets[1] + size[1]) / bc) * bc)
        values = read_weight((slice(r0, r1), slice(c0, c1)))
        scales = read_scale((slice(r0 // br, math.ceil(r1 / br)), slice(c0 // bc, math.ceil(c1 / bc))))
        if not scales.is_floating_point():
            raise ConfigError(f"block scales must be floating point, got {scales.dtype}")
        full = dequantize_fp8(values, scales.float(), self.block)
        top, left = offsets[0] - r0, offsets[1] - c0
        return full[top : top + size[0], left : left + size[1]]
