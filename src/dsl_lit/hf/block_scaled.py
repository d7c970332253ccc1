"""What DeepSeek's quantised checkpoint formats share: a weight ``W`` [out, in] stored as
low-precision values next to its scales (``W_scale_inv``; DeepSeek-V4's release names them
``<module>.scale``, its adapter maps the name), one scale per block of ``block`` elements (ragged
at the edges), its value the stored value times its block's scale, multiplied in fp32 (DeepSeek's
``weight_dequant``, transformers' ``Fp8Dequantize``).

The formats (:class:`~dsl_lit.hf.fp8_blocks.BlockFP8`, DeepSeek-V3's and V4's e4m3 in 128x128
blocks; :class:`~dsl_lit.hf.fp4_rows.FP4Rows`, DeepSeek-V4's e2m1 routed experts, two values a
byte, in 1x32 groups) differ in how values are packed and quantised; reading a region is the same
mechanism for both (:meth:`BlockScaled.read_region`): a process holding a tensor shard reads and
dequantises only the blocks that cover it.

Scales are stored as fp32 (``scale_fmt`` "float", DeepSeek-V3) or as ``float8_e8m0fnu`` powers of
two ("ue8m0", DeepSeek-V4): each block's scale is then rounded up to a power of two so that its
values still fit, and reads back exactly.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from data_contract.errors import ConfigError
from dsl_lit.models.common.hf_adapter import SCALE_SUFFIX

__all__ = ["SCALE_FMTS", "SCALE_SUFFIX", "BlockScaled", "ReadRegion", "Region"]

SCALE_FMTS = {"float": torch.float32, "ue8m0": torch.float8_e8m0fnu}
"""``quantization_config.scale_fmt`` -> the dtype the scales are stored in."""

Region = tuple[slice, ...]
ReadRegion = Callable[[Region], torch.Tensor]
"""Reads one region (a slice per dim) of a stored tensor."""


@dataclass(frozen=True)
class BlockScaled(ABC):
    """A block-scaled format: the block one scale covers, and how scales are stored."""

    block: tuple[int, int]
    scale_fmt: str = "float"

    kind: ClassVar[str]
    """What the values are, for messages ("FP8", "FP4")."""
    values_per_element: ClassVar[int] = 1
    """Values one stored element of the last dim holds (2 for FP4 packed two a byte)."""

    def __post_init__(self) -> None:
        if self.scale_fmt not in SCALE_FMTS:
            raise ConfigError(f"config.json quantization_config.scale_fmt={self.scale_fmt!r} is not supported; use "
                              "'float' (fp32 scales, DeepSeek-V3) or 'ue8m0' (float8_e8m0fnu powers of two, DeepSeek-V4)")

    @property
    def pow2(self) -> bool:
        return self.scale_fmt == "ue8m0"

    @property
    def scale_dtype(self) -> torch.dtype:
        return SCALE_FMTS[self.scale_fmt]

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """Shape of the ``_scale_inv`` tensor of a weight of (logical) ``shape``."""
        return (math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1]))

    def stored_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """Shape the file stores a weight of (logical) ``shape`` in."""
        return (shape[0], shape[1] // self.values_per_element)

    def logical_shape(self, stored: Sequence[int]) -> tuple[int, int]:
        """Shape of the weight a file stores in ``stored``."""
        return (stored[0], stored[1] * self.values_per_element)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D ``weight`` -> (the values as stored, the scales in the stored ``scale_fmt``)."""
        if weight.ndim != 2:
            raise ValueError(f"block quantisation takes 2-D weights, got shape {tuple(weight.shape)}")
        values, scales = self._quantize(weight)
        return values, scales.to(self.scale_dtype)  # exact for "ue8m0": powers of two

    @abstractmethod
    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stored values, fp32 scales: powers of two when :attr:`pow2`)."""

    @abstractmethod
    def dequantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Stored values (whole blocks) and their fp32 scales -> fp32 weights."""

    def read_region(
        self,
        read_weight: ReadRegion,
        read_scale: ReadRegion,
        shape: Sequence[int],
        offsets: Sequence[int],
        size: Sequence[int],
    ) -> torch.Tensor:
        """Rows ``[offsets[0], +size[0])`` x cols ``[offsets[1], +size[1])`` of a stored weight of
        (logical) ``shape``, dequantised (fp32): reads the values and scales of the blocks that
        cover the region only, dequantises them and crops."""
        (rows, cols), (br, bc) = shape, self.block
        r0, c0 = offsets[0] - offsets[0] % br, offsets[1] - offsets[1] % bc  # block-aligned region
        r1 = min(rows, math.ceil((offsets[0] + size[0]) / br) * br)
        c1 = min(cols, math.ceil((offsets[1] + size[1]) / bc) * bc)
        per = self.values_per_element  # bc is a multiple of it: a block never splits a stored element
        values = read_weight((slice(r0, r1), slice(c0 // per, c1 // per)))
        scales = read_scale((slice(r0 // br, math.ceil(r1 / br)), slice(c0 // bc, math.ceil(c1 / bc))))
        full = self.dequantize(values, scales.float())
        top, left = offsets[0] - r0, offsets[1] - c0
        return full[top : top + size[0], left : left + size[1]]
