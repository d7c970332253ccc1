"""The FP8 training recipes: how each operand of a Linear's three GEMMs is quantised (see ``fp8.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsl_lit.precision.fp8_kernel_rules import BLOCK, SCALED_MM_MULTIPLE
from dsl_lit.precision.fp8_quantize import E5M2, QuantSpec


@dataclass(frozen=True)
class Fp8Recipe:
    """Quantisation of each operand of the three GEMMs of ``Y = X W^T``, each in ``[rows, k]`` layout:
    fprop ``X [tokens, in]`` and ``W [out, in]``; dgrad ``dY [tokens, out]`` and ``W^T [in, out]``;
    wgrad ``dY^T [out, tokens]`` and ``X^T [in, tokens]``."""

    name: str
    x: QuantSpec
    w: QuantSpec
    dy: QuantSpec
    w_t: QuantSpec
    dy_t: QuantSpec
    x_t: QuantSpec
    dim_multiple: int
    """in/out features must be multiples of this (the GPU kernels' constraint)."""
    cache_fp8_input: bool = False
    """Save the fprop's FP8 copy of X for wgrad (DeepSeek-V3) instead of the high-precision X."""
    allows_bias: bool = True


_TENSOR, _ROW, _TILE, _BLOCK = (0, 0), (1, 0), (1, 128), (128, 128)

RECIPES: dict[str, Fp8Recipe] = {
    "fp8_tensorwise": Fp8Recipe(
        "fp8_tensorwise",
        x=QuantSpec(_TENSOR), w=QuantSpec(_TENSOR),
        dy=QuantSpec(_TENSOR, E5M2), w_t=QuantSpec(_TENSOR),
        dy_t=QuantSpec(_TENSOR, E5M2), x_t=QuantSpec(_TENSOR),
        dim_multiple=SCALED_MM_MULTIPLE,
    ),
    "fp8_rowwise": Fp8Recipe(
        "fp8_rowwise",
        x=QuantSpec(_ROW, pow2_scales=True), w=QuantSpec(_ROW, pow2_scales=True),
        dy=QuantSpec(_ROW, pow2_scales=True), w_t=QuantSpec(_ROW, pow2_scales=True),
        dy_t=QuantSpec(_ROW, pow2_scales=True), x_t=QuantSpec(_ROW, pow2_scales=True),
        dim_multiple=SCALED_MM_MULTIPLE,
    ),
    "fp8_blockwise": Fp8Recipe(
        "fp8_blockwise",
        x=QuantSpec(_TILE), w=QuantSpec(_BLOCK),
        dy=QuantSpec(_TILE), w_t=QuantSpec(_BLOCK),
        dy_t=QuantSpec(_TILE), x_t=QuantSpec(_TILE),  # i.e. 128x1 tiles of dY and X, over tokens
        dim_multiple=BLOCK, cache_fp8_input=True, allows_bias=False,
    ),
}
FP8_RECIPES: tuple[str, ...] = tuple(RECIPES)
"""The recipe names ``apply_fp8`` accepts."""

BLOCKWISE_TORCHAO_LIKE = dataclasses.replace(RECIPES["fp8_blockwise"], cache_fp8_input=False)
"""``fp8_blockwise`` as torchao's kernel computes it: wgrad quantises the saved bf16 X to 128x1
directly rather than re-quantising its FP8 1x128 copy."""
