"""Where SFT conversations come from: the generated task's reference replies, or a JSONL file whose
lines are in one of TRL's dataset formats:

- conversational, ``{"messages": [{"role": ..., "content": ...}, ...]}`` (what rejection sampling
  and distillation write, and the usual format of chat datasets);
- prompt-completion, ``{"prompt": "...", "completion": "..."}`` (a user turn and the assistant's
  reply) or its conversational form, ``{"prompt": [messages], "completion": [messages]}``.

TRL's plain ``{"text": ...}`` language-modelling rows are not chat: they are pretraining data
(``recipes/pretrain.py data.corpus_dir=...``)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dsl_lit.config.errors import ConfigError
from dsl_lit.config.posttrain import TaskConfig
from dsl_lit.posttrain.chat.jsonl import as_messages, read_jsonl
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


def _conversation(record: Any) -> Conversation | str:
    """A record's conversation in one of the formats above, or why it is none."""
    neither = "neither a non-empty 'messages' list nor 'prompt' and 'completion' (both strings or both message lists)"
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return neither
        return messages if as_messages(messages, "user") else "a message that is not {'role': str, 'content': str}"
    if isinstance(record, dict) and type(record.get("prompt")) is type(record.get("completion")):
        prompt, completion = as_messages(record.get("prompt"), "user"), as_messages(record.get("completion"), "assistant")
        if prompt and completion:
            return [*prompt, *completion]
    return neither


def read_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of a JSONL file. A line that is not JSON or not a conversation is counted
    and set aside (one warning naming the first few lines and why); a file that is missing or holds
    no conversation is a one-line ConfigError (before: a JSON error's traceback)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sft.dataset={path}: no such file (use 'task' or a .jsonl of conversations)")
    conversations, set_aside = read_jsonl(path, _conversation)
    if not conversations:
        raise ConfigError(f"{path} holds no conversation (each line: {{\"messages\": [{{\"role\": ..., \"content\": ...}}]}} "
                          "or {\"prompt\": ..., \"completion\": ...})" + (f"; {set_aside} line(s) set aside" if set_aside else ""))
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
