"""A readability rule for rejection sampling: the reasoning restates the question it answers.

R1 keeps only readable reasoning from its rejection sampling (section 2.3.3 filters out mixed
languages, long paragraphs and code blocks). The generated tasks' reference reasoning restates the
question, then gives the result (``<think>the largest of 6 0 4 8 = 8</think>``); a sample that
misquotes the list and still answers right was right by luck, and teaches whoever learns from it to
misquote. Measured on the reproduction's GRPO models (2026-11-29, 2-core Xeon): 52% and 76% of their
verified samples restated the question exactly; SFT of the pretrained model on all of them reached
28% and 70% held-out (seed 1234's never learned to copy the list in its 300 steps: loss stuck at
0.5), on the restating ones 83% and 64%; kept by this rule while sampling (893 / 1,212 samples),
99% and 79%.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsl_lit.posttrain.rewards.format import think_block


def restatement_reward(completion: str, sample: Mapping[str, Any] | None = None) -> float:
    """1.0 when the reasoning, up to its first `` = ``, is ``sample["question"]`` exactly (the form
    ``<question> = <result>`` of the generated tasks' replies), else 0.0 (no question, no think
    block, no `` = ``, or another text before it)."""
    question = (sample or {}).get("question")
    reasoning = think_block(completion)
    if not question or reasoning is None or " = " not in reasoning:
        return 0.0
    return 1.0 if reasoning.split(" = ", 1)[0].strip() == question.strip() else 0.0
