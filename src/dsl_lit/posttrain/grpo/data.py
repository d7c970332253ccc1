"""RL prompts as rows: ``prompt_ids`` (right-padded), ``prompt_lens`` and ``index`` into the list
of problems (whose ``answer`` the reward checks), so the sampler and resumption work as for any
other rows."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dsl_lit.config.errors import ConfigError
from dsl_lit.posttrain.chat.datamodule import Rows
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.posttrain.rewards.accuracy import CHECKERS
from dsl_lit.tasks import arithmetic

log = logging.getLogger(__name__)


def problem_prompt(problem: dict[str, Any]) -> list[dict[str, str]]:
    """A problem's prompt messages: its own (a prompts file's) or the generated task's question."""
    return problem["messages"] if "messages" in problem else arithmetic.prompt(problem)


def encode_prompts(problems: Sequence[dict[str, Any]], tokenizer: ChatTokenizer) -> list[list[int]]:
    """The chat-formatted prompt tokens of each problem."""
    return [tokenizer.encode_prompt(problem_prompt(p)) for p in problems]


def read_problems(path: str | Path) -> list[dict[str, Any]]:
    """Prompts with reference answers from a JSONL file (``grpo.dataset``): ``prompt`` (a string,
    the user's turn, or messages), ``answer`` (what the accuracy reward checks) and an optional
    ``checker``. A line that is not JSON or lacks them is counted and set aside (one warning naming
    the first lines); none left is one line."""
    problems, set_aside = [], []
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                set_aside.append(f"{n} (not JSON)")
                continue
            prompt = record.get("prompt") if isinstance(record, dict) else None
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            valid = isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)
            checker = record.get("checker") if isinstance(record, dict) else None
            if not valid or not isinstance(record.get("answer"), (str, int, float)) or \
                    checker not in (None, *CHECKERS, "boxed"):
                set_aside.append(f"{n} (needs 'prompt' (a string or messages) and 'answer'; 'checker' one of "
                                 f"{[*CHECKERS, 'boxed']})")
                continue
            problems.append({"messages": messages, "answer": str(record["answer"]),
                             **({"checker": checker} if checker else {})})
    if set_aside:
        log.warning("%s: %d line(s) set aside: %s%s", path, len(set_aside), "; ".join(set_aside[:3]),
                    "; ..." if len(set_aside) > 3 else "")
    if not problems:
        raise ConfigError(f"grpo.dataset={path} holds no prompt with an answer; {len(set_aside)} line(s) set aside")
    return problems


def prompt_rows(problems: Sequence[dict[str, Any]], tokenizer: ChatTokenizer) -> Rows:
    ids = encode_prompts(problems, tokenizer)
    width = max(map(len, ids))
    prompt_ids = torch.full((len(ids), width), tokenizer.pad_id, dtype=torch.long)
    for i, row in enumerate(ids):
        prompt_ids[i, : len(row)] = torch.tensor(row)
    return {"prompt_ids": prompt_ids, "prompt_lens": torch.tensor(list(map(len, ids))),
            "index": torch.arange(len(ids))}


def prompts_of(batch: Rows) -> list[list[int]]:
    """The token lists of a batch of prompt rows."""
    return [row[:n].tolist() for row, n in zip(batch["prompt_ids"], batch["prompt_lens"].tolist())]
