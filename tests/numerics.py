"""Tolerances derived from fp32 arithmetic, for tests that compare two computations of one tensor.

Two correct fp32 computations of the same value (one process vs a parallel layout, micro-batches
vs the whole batch, a fused kernel vs autograd) differ only by the order of their additions. Summing
``n`` terms in another order moves the result by about ``eps * sqrt(n)`` times the size of the terms
(rounding errors add up like a random walk; ``eps * n`` is the worst case), so the bound scales with
the reference's magnitude and the length of the longest reduction behind it. We bound an element's
error by the *tensor's* largest magnitude, not the element's own: an entry that is a near-cancelling
sum (a gradient close to zero) carries the absolute error of its large terms, which is what made a
fixed ``atol=1e-6`` fail on one element of 2560 on another CPU (issue 17, item 14).

A bug (a dropped term, a shard in the wrong place, a wrong normaliser) moves values by a sizeable
fraction of their magnitude, orders of magnitude above these bounds.
"""

from __future__ import annotations

import math

import torch

EPS32 = torch.finfo(torch.float32).eps
"""2^-23: the spacing of fp32 numbers at 1.0 (twice the unit roundoff)."""


def fp32_tolerance(reference: torch.Tensor, reduction_len: int, k: float = 8.0) -> dict[str, float]:
    """``torch.testing.assert_close`` keywords for comparing against ``reference`` when the two sides
    differ only by reordered fp32 sums of up to ``reduction_len`` terms.

    ``atol = k * eps * sqrt(reduction_len) * max|reference|`` and ``rtol = k * eps * sqrt(reduction_len)``;
    ``k`` is the safety factor over the random-walk estimate (a few standard deviations)."""
    scale = k * EPS32 * math.sqrt(max(1, reduction_len))
    magnitude = reference.detach().abs().max().item() if reference.numel() else 0.0
    return {"atol": scale * magnitude, "rtol": scale}


def assert_close_fp32(
    actual: torch.Tensor, reference: torch.Tensor, reduction_len: int, k: float = 8.0, msg: str = ""
) -> None:
    """``assert_close`` with :func:`fp32_tolerance` (DTensors compare their full tensors)."""
    if hasattr(actual, "full_tensor"):
        actual = actual.full_tensor()
    if hasattr(reference, "full_tensor"):
        reference = reference.full_tensor()
    tolerance = fp32_tolerance(reference, reduction_len, k)
    torch.testing.assert_close(actual, reference, **tolerance, msg=lambda m: f"{msg} ({tolerance}): {m}")


def assert_close_in_norm(
    actual: torch.Tensor, reference: torch.Tensor, reduction_len: int, k: float = 8.0, msg: str = ""
) -> None:
    """``||actual - reference|| <= k * eps * sqrt(reduction_len) * ||reference||``: the bound of
    :func:`fp32_tolerance` for the tensor as a whole. For weights after AdamW steps: Adam divides
    each gradient entry by its own magnitude, so an entry whose gradient is a near-cancelling sum
    (relative error up to 1) can step differently by up to lr, while the tensor stays within the
    bound; a wrong update moves the whole tensor by ~lr, far outside it."""
    bound = k * EPS32 * math.sqrt(max(1, reduction_len))
    error = relative_error(actual, reference)
    assert error <= bound, f"{msg}: relative error {error:.3g} > {bound:.3g}"


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference|| / ||reference||`` in float64: one number for a whole tensor, for
    comparisons whose error is not elementwise (lower precision, an optimizer step)."""
    reference = reference.detach().double()
    return ((actual.detach().double() - reference).norm() / reference.norm().clamp_min(1e-300)).item()
