"""RL prompts as rows: ``prompt_ids`` (right-padded), ``prompt_lens`` and ``index`` into the list
of problems (whose ``answer`` the reward checks), so the sampler and resumption work as for any
other rows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data_contract.errors import ConfigError
from dsl_lit.posttrain.chat.datamodule import Rows
from dsl_lit.posttrain.chat.records import as_messages, read_records
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.posttrain.rewards.accuracy import CHECKERS
from dsl_lit.tasks import arithmetic


def problem_prompt(problem: dict[str, Any]) -> list[dict[str, str]]:
    """A problem's prompt messages: its own (a prompts file's) or the generated task's question."""
    return problem["messages"] if "messages" in problem else arithmetic.prompt(problem)


def encode_prompts(problems: Sequence[dict[str, Any]], tokenizer: ChatTokenizer) -> list[list[int]]:
    """The chat-formatted prompt tokens of each problem."""
    return [tokenizer.encode_prompt(problem_prompt(p)) for p in problems]


def _problem(record: Any) -> dict[str, Any] | str:
    """A prompts-file row as a problem (``messages``, ``answer``, ``checker``), or why it is none."""
    messages = as_messages(record.get("prompt"), "user") if isinstance(record, dict) else None
    checker = record.get("checker") if isinstance(record, dict) else None
    if messages is None or not isinstance(record.get("answer"), (str, int, float)) or checker not in (None, *CHECKERS, "boxed"):
        return f"needs 'prompt' (a string or messages) and 'answer'; 'checker' one of {[*CHECKERS, 'boxed']}"
    return {"messages": messages, "answer": str(record["answer"]), **({"checker": checker} if checker else {})}


def read_problems(path: str | Path) -> list[dict[str, Any]]:
    """Prompts with reference answers from a JSONL file or datasets directory (``grpo.dataset``):
    ``prompt`` (a string, the user's turn, or messages), ``answer`` (what the accuracy reward
    checks) and an optional ``checker``. A record that is not JSON or lacks them is counted and set
    aside (one warning naming the first ones); none left is one line."""
    problems, set_aside = read_records(path, _problem)
    if not problems:
        raise ConfigError(f"grpo.dataset={path} holds no prompt with an answer; {set_aside} record(s) set aside")
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
