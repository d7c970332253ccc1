"""The FP8 training recipes as one table, torch-free: what validation accepts and what the runtime
does (``dsl_lit.precision``) are both read from a recipe's row, never from its name.

A new recipe is one row here plus one ``conf/precision/<name>.yaml``; every behaviour follows from
its fields: the quantisation of each GEMM operand, the kernels' shape rules, torchao's module for it
and the GPU it needs. ``tests/unit/precision/test_precision.py`` adds a recipe that way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Block = tuple[int, int]
"""``(rows, k)`` elements of a ``[rows, k]`` operand (k: the contraction dim) that share one scale;
``0`` is the whole dim: ``(0, 0)`` tensorwise, ``(1, 0)`` rowwise, ``(1, 128)`` 1x128 tiles,
``(128, 128)`` blocks."""

SCALED_MM_MULTIPLE = 16
"""``torch._scaled_mm``: every dim but mat1's rows, tokens included where they are contracted (wgrad)."""
BLOCK = 128
"""torchao's blockwise kernels: tiles of 1x128 / 128x1 / 128x128."""


@dataclass(frozen=True)
class Operand:
    """How one operand of a GEMM is quantised."""

    block: Block
    e5m2: bool = False
    """E5M2 (range for gradients) instead of E4M3."""
    pow2_scales: bool = False
    """Scales rounded down to powers of two (exact rescaling)."""


@dataclass(frozen=True)
class Fp8RecipeRow:
    """One FP8 recipe. Operands of the three GEMMs of ``Y = X W^T``, each ``[rows, k]``: fprop ``X``
    and ``W``; dgrad ``dY`` and ``W^T``; wgrad ``dY^T`` and ``X^T``."""

    name: str
    x: Operand
    w: Operand
    dy: Operand
    w_t: Operand
    dy_t: Operand
    x_t: Operand
    kernel: Literal["scaled_mm", "blockwise"]
    """The GEMM the GPU runs: ``torch._scaled_mm`` (per-tensor or per-row scales) or torchao's
    Triton blockwise kernels; their shape rules (``precision/fp8_kernel_rules.py``) and our
    reference module follow from it."""
    dim_multiple: int
    """A Linear's in/out features must be multiples of this to run in FP8 (others stay in bf16)."""
    token_multiple: int
    """Tokens per GEMM must be a multiple of this (wgrad contracts over them): padded when not."""
    torchao_linear: str
    """torchao's module for the Linears: ``float8:<Float8LinearConfig recipe name>`` or ``blockwise``
    (``Float8BlockwiseLinear``)."""
    min_capability: tuple[int, int]
    """The GPU torchao's Linears need (compute capability)."""
    experts_rowwise: bool = False
    """Whether the recipe's routed experts are what torchao's MoE training computes (it offers
    rowwise scaling only: another recipe's experts run rowwise, with a warning)."""
    cache_fp8_input: bool = False
    """Save the fprop's FP8 copy of X for wgrad (DeepSeek-V3) instead of the high-precision X."""
    allows_bias: bool = True


EXPERTS_MIN_CAPABILITY = (9, 0)
"""torchao's FP8 grouped GEMM (routed experts): Hopper or newer, any recipe."""

_TENSOR, _ROW, _TILE, _BLOCK = Operand((0, 0)), Operand((1, 0), pow2_scales=True), Operand((1, BLOCK)), Operand((BLOCK, BLOCK))

ROWS: tuple[Fp8RecipeRow, ...] = (
    Fp8RecipeRow("fp8_tensorwise", x=_TENSOR, w=_TENSOR, dy=Operand((0, 0), e5m2=True), w_t=_TENSOR,
                 dy_t=Operand((0, 0), e5m2=True), x_t=_TENSOR, kernel="scaled_mm", dim_multiple=SCALED_MM_MULTIPLE,
                 token_multiple=SCALED_MM_MULTIPLE, torchao_linear="float8:tensorwise", min_capability=(8, 9)),
    Fp8RecipeRow("fp8_rowwise", x=_ROW, w=_ROW, dy=_ROW, w_t=_ROW, dy_t=_ROW, x_t=_ROW, kernel="scaled_mm",
                 dim_multiple=SCALED_MM_MULTIPLE, token_multiple=SCALED_MM_MULTIPLE, torchao_linear="float8:rowwise",
                 min_capability=(9, 0), experts_rowwise=True),
    # DeepSeek-V3: 1x128 tiles of activations and gradients, 128x128 blocks of weights; dY^T and X^T
    # in 1x128 tiles of their [features, tokens] layout, i.e. 128x1 tiles over tokens
    Fp8RecipeRow("fp8_blockwise", x=_TILE, w=_BLOCK, dy=_TILE, w_t=_BLOCK, dy_t=_TILE, x_t=_TILE, kernel="blockwise",
                 dim_multiple=BLOCK, token_multiple=BLOCK, torchao_linear="blockwise", min_capability=(9, 0),
                 cache_fp8_input=True, allows_bias=False),
)

FP8_RECIPES: dict[str, Fp8RecipeRow] = {row.name: row for row in ROWS}
"""The recipes ``precision.fp8`` accepts, by name."""
