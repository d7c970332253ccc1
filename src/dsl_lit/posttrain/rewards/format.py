"""R1's format reward: the completion is exactly ``<think>...</think><answer>...</answer>``.

Whitespace around and between the two blocks is allowed; nothing else is (no text before
``<think>``, after ``</answer>``, and no nested or repeated tags), so the reward cannot be earned by
sprinkling tags into free text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_FORMAT = re.compile(r"\s*<think>((?:(?!</?think>|</?answer>).)*)</think>\s*<answer>((?:(?!</?think>|</?answer>).)*)</answer>\s*",
                     re.DOTALL)


def format_reward(completion: str, sample: Mapping[str, Any] | None = None) -> float:
    """1.0 when ``completion`` is one think block followed by one answer block, else 0.0."""
    return 1.0 if _FORMAT.fullmatch(completion) else 0.0


def think_block(completion: str) -> str | None:
    """The reasoning inside the first ``<think>...</think>``, or None."""
    match = re.search(r"<think>(.*?)</think>", completion, re.DOTALL)
    return match.group(1) if match else None
