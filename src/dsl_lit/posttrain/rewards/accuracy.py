"""Accuracy rewards: extract the final answer and check it against the sample's reference.

The answer is the content of the last ``<answer>...</answer>`` block, else of the last
``\\boxed{...}`` (braces matched, so ``\\boxed{\\frac{1}{2}}`` works). Checkers per task:
``exact`` (string equality after trimming), ``numeric`` (both parse as numbers, fractions and
thousands separators included, and agree within 1e-6 relative), ``boxed`` (the answer must be
given as ``\\boxed{...}`` and then checks numerically, else exactly).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer: the last ``<answer>`` block (a ``\\boxed{}`` inside it wins), else the last
    ``\\boxed{}`` anywhere, else None."""
    blocks = _ANSWER.findall(text)
    if blocks:
        inner = blocks[-1]
        return extract_boxed(inner) or inner.strip()
    return extract_boxed(text)


def parse_number(text: str) -> float | None:
    """A number from ``-12``, ``3.5``, ``1,234``, ``7/2``, ``\\frac{7}{2}``, ``$4$``; None otherwise."""
    s = text.strip().strip("$").replace(",", "").replace(" ", "")
    frac = re.fullmatch(r"(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if frac:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    try:
        value = float(Fraction(s)) if re.fullmatch(r"-?\d+(\.\d+)?(/-?\d+)?", s) else float(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def exact_match(predicted: str, reference: str) -> bool:
    return predicted.strip() == reference.strip()


def numeric_match(predicted: str, reference: str) -> bool:
    a, b = parse_number(predicted), parse_number(reference)
    if a is None or b is None:
        return False
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _boxed_match(completion: str, reference: str) -> bool:
    boxed = extract_boxed(completion)
    if boxed is None:
        return False
    return numeric_match(boxed, reference) or exact_match(boxed, reference)


CHECKERS: dict[str, Callable[[str, str], bool]] = {"exact": exact_match, "numeric": numeric_match}


def accuracy_reward(completion: str, sample: Mapping[str, Any], checker: str | None = None) -> float:
    """1.0 when the completion's final answer matches ``sample["answer"]`` with ``checker``
    (default: ``sample["checker"]``, else ``numeric``), else 0.0."""
    checker = checker or sample.get("checker", "numeric")
    reference = str(sample["answer"])
    if checker == "boxed":
        return 1.0 if _boxed_match(completion, reference) else 0.0
    if checker not in CHECKERS:
        raise ValueError(f"checker={checker!r} is unknown; choose one of {[*CHECKERS, 'boxed']}")
    predicted = extract_answer(completion)
    return 1.0 if predicted is not None and CHECKERS[checker](predicted, reference) else 0.0
