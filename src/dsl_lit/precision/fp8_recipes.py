"""The FP8 training recipes with torch dtypes: how each operand of a Linear's three GEMMs is quantised
(see ``fp8.py``), built from the table's rows (``dsl_lit.config.fp8_recipes``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsl_lit.config.fp8_recipes import FP8_RECIPES as FP8_TABLE
from dsl_lit.config.fp8_recipes import Fp8RecipeRow, Operand
from dsl_lit.precision.fp8_quantize import E4M3, E5M2, QuantSpec


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
    token_multiple: int
    """tokens per GEMM must be a multiple of this (wgrad contracts over them)."""
    kernel: str
    """``scaled_mm`` or ``blockwise``: the GPU kernel whose shape rules apply (``fp8_kernel_rules``)."""
    cache_fp8_input: bool = False
    """Save the fprop's FP8 copy of X for wgrad (DeepSeek-V3) instead of the high-precision X."""
    allows_bias: bool = True


def quant_spec(operand: Operand) -> QuantSpec:
    return QuantSpec(operand.block, E5M2 if operand.e5m2 else E4M3, operand.pow2_scales)


def from_row(row: Fp8RecipeRow) -> Fp8Recipe:
    """The recipe of a table row (``dsl_lit.config.fp8_recipes``) with torch dtypes."""
    specs = {name: quant_spec(getattr(row, name)) for name in ("x", "w", "dy", "w_t", "dy_t", "x_t")}
    return Fp8Recipe(row.name, **specs, dim_multiple=row.dim_multiple, token_multiple=row.token_multiple,
                     kernel=row.kernel, cache_fp8_input=row.cache_fp8_input, allows_bias=row.allows_bias)


def recipe_named(name: str) -> Fp8Recipe:
    """The recipe of the table's row ``name`` (read at call time: a row added later counts)."""
    if name not in FP8_TABLE:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {tuple(FP8_TABLE)}")
    return from_row(FP8_TABLE[name])


RECIPES: dict[str, Fp8Recipe] = {name: from_row(row) for name, row in FP8_TABLE.items()}
FP8_RECIPES: tuple[str, ...] = tuple(RECIPES)
"""The recipe names ``apply_fp8`` accepts."""

BLOCKWISE_TORCHAO_LIKE = dataclasses.replace(RECIPES["fp8_blockwise"], cache_fp8_input=False)
"""``fp8_blockwise`` as torchao's kernel computes it: wgrad quantises the saved bf16 X to 128x1
directly rather than re-quantising its FP8 1x128 copy."""
