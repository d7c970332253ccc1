"""Precision recipes applied to a built model from outside (the models stay plain PyTorch)."""

from dsl_lit.precision.fp8 import (
    DEFAULT_FP8_FILTER_FQNS,
    FP8_RECIPES,
    BlockwiseFp8Linear,
    Fp8GroupedExperts,
    Fp8Linear,
    apply_fp8,
)

__all__ = [
    "DEFAULT_FP8_FILTER_FQNS",
    "FP8_RECIPES",
    "BlockwiseFp8Linear",
    "Fp8GroupedExperts",
    "Fp8Linear",
    "apply_fp8",
]
