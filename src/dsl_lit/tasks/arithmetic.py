"""A generated, verifiable task: integer arithmetic with R1-style answers.

Why generated: no dataset can be downloaded here, and GRPO needs prompts whose answers a rule can
check. Every problem is ``a op b`` with operands up to ``max_operand`` (or ``the largest of a b c d``,
``list_length`` of them: a skill rather than a table of facts, so held-out problems test what was
learned, not what was memorised); its reference reply is ``<think>a op b = c</think><answer>c</answer>``, which the SFT/cold-start data, the preference pairs
(a wrong result as the rejected reply) and the accuracy reward all derive from. Deterministic from
the seed; problems are distinct, and the last ``eval_problems`` of them are held out.
"""

from __future__ import annotations

import random
from typing import Any

from dsl_lit.config.posttrain import TaskConfig

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def problems(cfg: TaskConfig) -> list[dict[str, Any]]:
    """Distinct problems: ``{"question", "answer", "checker", "language"}``, deterministic in the seed."""
    rng = random.Random(cfg.seed)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    out: list[dict[str, Any]] = []
    while len(out) < cfg.num_problems:
        a, b, op = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_operand), rng.choice(cfg.operations)
        numbers = (a, b)
        if op == "largest" and cfg.uniform_largest:  # the largest first, then the others at most it
            top, place = rng.randint(0, cfg.max_operand), rng.randrange(cfg.list_length)
            numbers = tuple(top if i == place else rng.randint(0, top) for i in range(cfg.list_length))
        elif op == "largest":
            numbers += tuple(rng.randint(0, cfg.max_operand) for _ in range(cfg.list_length - 2))
        if (op, numbers) in seen:
            continue
        seen.add((op, numbers))
        if op == "largest":
            question, answer = "the largest of " + " ".join(map(str, numbers)), max(numbers)
        else:
            question, answer = f"{numbers[0]} {op} {numbers[1]}", OPERATIONS[op](*numbers)
        out.append({"question": question, "answer": str(answer), "checker": "numeric", "language": cfg.language})
    return out


def split(cfg: TaskConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training problems, held-out problems)."""
    all_problems = problems(cfg)
    cut = len(all_problems) - cfg.eval_problems
    return all_problems[:cut], all_problems[cut:]


def prompt(problem: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {problem['question']}?"}]


def reply(problem: dict[str, Any], answer: str | None = None) -> str:
    """The R1-format reply (with ``answer`` instead of the right one, for rejected replies)."""
    result = problem["answer"] if answer is None else answer
    return f"<think>{problem['question']} = {result}</think><answer>{result}</answer>"


def shortcut_answer(problem: dict[str, Any]) -> str:
    """A plausible wrong rule: the question's last number (right for ``largest`` when the last number
    is the largest, about a third of the time over 4 digits). An imperfect cold start that imitates
    it in part of its replies gives RL a model whose samples find the right rule less often than
    they find the shortcut (``grpo.cold_start_shortcut``)."""
    return problem["question"].split()[-1]


def wrong_answer(problem: dict[str, Any], rng: random.Random) -> str:
    """A plausible wrong result: the right one off by 1 to 3."""
    return str(int(problem["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3]))


def rejected_reply(problem: dict[str, Any], rng: random.Random) -> str:
    """A reply the rules reject: half the time a wrong result in the right format, half the time
    the right result without the think/answer format (so a preference is learnable even by a
    model that cannot add yet)."""
    if rng.random() < 0.5:
        return reply(problem, wrong_answer(problem, rng))
    return f"The answer is {problem['answer']}."
