"""Numerical ops shared by every objective."""

from dsl_lit.ops.cross_entropy import chunk_kernels_backend, compile_chunk_kernels, cross_entropy

__all__ = ["chunk_kernels_backend", "compile_chunk_kernels", "cross_entropy"]
