"""Numerical ops shared by every objective."""

from dsl_lit.ops.cross_entropy import cross_entropy

__all__ = ["cross_entropy"]
