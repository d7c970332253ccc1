"""The shape rules of the GPU FP8 kernels, checked by the CPU reference path with the same messages.

Why: torch's CPU ``_scaled_mm`` and our reference GEMMs accept any shape, while the CUDA kernels
refuse some (a 1016-token batch, MTP's 127-token shifted sequences, an expert with 37 tokens). A
CPU test that never sees those refusals cannot catch a layer that feeds them; so the reference
path runs every GEMM through :func:`check_gemm` (and routed experts through
:func:`check_token_groups`), and the FP8 layers make the rules hold by padding tokens
(:mod:`dsl_lit.models.common.token_padding`).

Each rule names the kernel it mirrors (torch 2.11 / torchao 0.18 source):

* ``_scaled_mm`` (tensorwise, rowwise; ``aten/src/ATen/native/cuda/Blas.cpp``, ``_scaled_mm_out_cuda``):
  mat1 ``[m, k]`` needs ``k % 16 == 0``, mat2 ``[k, n]`` needs ``k`` and ``n`` multiples of 16. In
  wgrad ``dW = dY^T X`` the contraction ``k`` is the token count.
* torchao's blockwise Linear (``prototype/blockwise_fp8_training/kernels.py``):
  ``triton_fp8_blockwise_act_quant_lhs`` (fprop X, dgrad dY) needs the last dim a multiple of 128;
  ``triton_fp8_blockwise_act_quant_transposed_lhs`` (wgrad dY, X: 128x1 tiles over tokens) needs the
  *first* dim, the token count, a multiple of 128; ``triton_fp8_blockwise_weight_quant_*`` needs
  both weight dims multiples of 128.
* torchao's FP8 grouped GEMM for routed experts (``prototype/moe_training/fp8_grouped_mm.py``, over
  ``torch._scaled_grouped_mm``): "Group sizes must be divisible by 16", checked on the GPU only by
  a device-side assert (which is how an unaligned MoE step fails there).
"""

from __future__ import annotations

from collections.abc import Sequence

from dsl_lit.config.fp8_recipes import BLOCK, FP8_RECIPES, SCALED_MM_MULTIPLE  # noqa: F401 (re-exported)

GROUPED_MM_GROUP_MULTIPLE = 16
"""torchao's FP8 grouped GEMM: each expert's token group size."""


def token_multiple(recipe_name: str) -> int:
    """What the token count of an FP8 Linear must be a multiple of under ``recipe_name``:
    wgrad contracts over tokens (16 for ``_scaled_mm``; 128 for the 128x1 blockwise tiles)."""
    return FP8_RECIPES[recipe_name].token_multiple


def _shape(t: Sequence[int]) -> str:
    return "x".join(str(d) for d in t)


def check_gemm(recipe_name: str, gemm: str, a: Sequence[int], b: Sequence[int]) -> None:
    """Raise as the GPU kernel would for ``a [m, k] @ b [n, k]^T`` (``gemm``: fprop, dgrad or wgrad;
    the operands as the reference lays them out: fprop ``X``, ``W``; dgrad ``dY``, ``W^T``; wgrad
    ``dY^T``, ``X^T``)."""
    (m, k), (n, _) = a, b
    if FP8_RECIPES[recipe_name].kernel == "scaled_mm":  # _scaled_mm(mat1=a, mat2=b^T)
        if k % SCALED_MM_MULTIPLE:
            raise RuntimeError(
                f"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: ({m}x{k})."
            )
        if n % SCALED_MM_MULTIPLE:
            raise RuntimeError(f"mat2 shape ({k}x{n}) must be divisible by 16")
        return
    if gemm == "wgrad":  # act_quant_transposed_lhs on dY [tokens, out] and X [tokens, in]
        if k % BLOCK:
            raise AssertionError(f"First dimension size must be divisible by block_size (block_size={BLOCK})")
    elif k % BLOCK:  # act_quant_lhs on X [tokens, in] (fprop) or dY [tokens, out] (dgrad)
        raise AssertionError(f"Last dimension size must be divisible by block_size (block_size={BLOCK})")
    if gemm != "wgrad" and n % BLOCK:  # the weight's 128x128 blocks
        raise AssertionError(f"Both dimensions of x must be divisible by block_size (block_size={BLOCK})")


def check_token_groups(counts: Sequence[int]) -> None:
    """Raise where torchao's FP8 grouped GEMM would fail on these per-expert token counts."""
    bad = [c for c in counts if c % GROUPED_MM_GROUP_MULTIPLE]
    if bad:
        raise RuntimeError(
            f"Group sizes must be divisible by {GROUPED_MM_GROUP_MULTIPLE} (torch._scaled_grouped_mm "
            f"offsets), got token groups {list(counts)}"
        )
