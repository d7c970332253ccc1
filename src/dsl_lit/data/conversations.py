"""Where SFT conversations come from: the generated task's reference replies, or a JSONL file of
``{"messages": [{"role": ..., "content": ...}, ...]}`` (what rejection sampling and distillation
write, and the usual format of chat datasets)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dsl_lit.config.posttrain import TaskConfig
from dsl_lit.data import arithmetic

Conversation = list[dict[str, str]]


def task_conversations(task: TaskConfig) -> list[Conversation]:
    """The task's training problems as user question + R1-format reference reply."""
    train, _ = arithmetic.split(task)
    return [[*arithmetic.prompt(p), {"role": "assistant", "content": arithmetic.reply(p)}] for p in train]


def read_conversations(path: str | Path) -> list[Conversation]:
    conversations = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
                raise ValueError(f"{path}:{n}: expected an object with a 'messages' list")
            conversations.append(record["messages"])
    if not conversations:
        raise ValueError(f"{path} holds no conversations")
    return conversations


def write_conversations(path: str | Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Write records (each with ``messages``, plus any metadata) as JSONL; returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def load_conversations(dataset: str, task: TaskConfig) -> list[Conversation]:
    """``dataset`` is ``task`` (generated) or a JSONL path."""
    return task_conversations(task) if dataset == "task" else read_conversations(dataset)
