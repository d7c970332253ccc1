"""RL prompts as rows: ``prompt_ids`` (right-padded), ``prompt_lens`` and ``index`` into the list
of problems (whose ``answer`` the reward checks), so the sampler and resumption work as for any
other rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dsl_lit.posttrain.chat.datamodule import Rows
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.tasks import arithmetic


def encode_prompts(problems: Sequence[dict[str, Any]], tokenizer: ChatTokenizer) -> list[list[int]]:
    """The chat-formatted prompt tokens of each problem."""
    return [tokenizer.encode_prompt(arithmetic.prompt(p)) for p in problems]


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
