"""Where SFT conversations come from: the generated task's reference replies, or a JSONL file of
``{"messages": [{"role": ..., "content": ...}, ...]}`` (what rejection sampling and distillation
write, and the usual format of chat datasets)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dsl_lit.config.posttrain import TaskConfig
from dsl_lit.tasks import arithmetic

Conversation = list[dict[str, str]]


def task_conversations(task: TaskConfig, shortcut_share: float = 0.0) -> list[Conversation]:
    """The task's training problems as user question + R1-format reference reply; a
    ``shortcut_share`` of the replies (drawn from the task's seed) answer with
    :func:`~dsl_lit.tasks.arithmetic.shortcut_answer` instead."""
    train, _ = arithmetic.split(task)
    rng = random.Random(f"{task.seed}/shortcut")
    replies = [arithmetic.reply(p, arithmetic.shortcut_answer(p) if rng.random() < shortcut_share else None)
               for p in train]
    return [[*arithmetic.prompt(p), {"role": "assistant", "content": r}] for p, r in zip(train, replies)]


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


def load_conversations(dataset: str, task: TaskConfig, shortcut_share: float = 0.0) -> list[Conversation]:
    """``dataset`` is ``task`` (generated, ``shortcut_share`` of its replies by the shortcut rule)
    or a JSONL path."""
    return task_conversations(task, shortcut_share) if dataset == "task" else read_conversations(dataset)
