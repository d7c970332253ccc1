"""Preference pairs -> DPO rows: each sample is one pair, ``[2, seq]`` (chosen, rejected), so that
a batch interleaves them and one forward scores both sides of every pair.

Labels keep only the reply's tokens (prompt masked), so a row's summed log-prob is log p(reply |
prompt). The generated pairs put the task's correct reply against a wrong result or an unformatted reply.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from data_contract.errors import ConfigError
from dsl_lit.config.posttrain import TaskConfig
from dsl_lit.posttrain.chat.datamodule import Rows
from dsl_lit.posttrain.chat.records import as_messages, read_records
from dsl_lit.posttrain.chat.rows import check_targets, document, padded_rows
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer, prompt_and_reply
from dsl_lit.tasks import arithmetic


def task_pairs(task: TaskConfig, num_pairs: int) -> list[dict]:
    """``{"prompt", "chosen", "rejected"}`` from the task's training problems (deterministic)."""
    train, _ = arithmetic.split(task)
    rng = random.Random(task.seed + 1)
    return [
        {"prompt": arithmetic.prompt(p), "chosen": arithmetic.reply(p),
         "rejected": arithmetic.rejected_reply(p, rng)}
        for p in (train[i % len(train)] for i in range(num_pairs))
    ]


def _pair(record: Any) -> dict | str:
    """A TRL preference row as ``{"prompt", "chosen", "rejected"}`` messages, or why it is none."""
    sides = [as_messages(record.get(key), role) if isinstance(record, dict) else None
             for key, role in (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant"))]
    if None in sides or sides[1][-1]["role"] != "assistant" or sides[2][-1]["role"] != "assistant":
        return "not prompt/chosen/rejected strings or messages ending with the assistant"
    return {"prompt": sides[0], "chosen": sides[1], "rejected": sides[2]}


def read_pairs(path: str | Path) -> list[dict]:
    """TRL's preference rows of a JSONL file or datasets directory (``prompt``, ``chosen``,
    ``rejected``; strings or message lists, a reply ending with the assistant's turn). A record that
    is not JSON or not such a row is counted and set aside (one warning naming the first ones and
    why); none left: one line."""
    pairs, set_aside = read_records(path, _pair)
    if not pairs:
        raise ConfigError(f"dpo.dataset={path} holds no preference pair (each line: {{\"prompt\": ..., \"chosen\": ..., "
                          f"\"rejected\": ...}}); {set_aside} record(s) set aside")
    return pairs


def load_pairs(dataset: str, task: TaskConfig, num_pairs: int) -> list[dict]:
    """``dataset`` is ``task`` (``num_pairs`` generated pairs) or a JSONL path or datasets directory."""
    return task_pairs(task, num_pairs) if dataset == "task" else read_pairs(dataset)


def preference_rows(pairs: list[dict], tokenizer: ChatTokenizer, seq_len: int) -> Rows:
    """``input_ids``, ``labels`` [pairs, 2, seq_len] (index 0 chosen, 1 rejected)."""
    docs = [
        document(tokenizer.encode_conversation(
            [*map(dict, pair["prompt"]), *pair[side]] if isinstance(pair[side], list)
            else prompt_and_reply(pair["prompt"], pair[side])), seq_len)
        for pair in pairs for side in ("chosen", "rejected")
    ]
    check_targets(docs, "dpo pairs")
    rows = padded_rows(docs, seq_len, tokenizer.pad_id)
    return {k: v.view(len(pairs), 2, seq_len) for k, v in rows.items()}


def collate_pairs(samples: list[dict[str, torch.Tensor]]) -> Rows:
    """Stack pairs and flatten to rows ``[c0, r0, c1, r1, ...]``."""
    return {k: torch.stack([s[k] for s in samples]).flatten(0, 1) for k in samples[0]}
