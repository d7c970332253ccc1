"""Where SFT examples come from: the generated task's reference replies, or a JSONL file (or a
``datasets`` save_to_disk directory, :mod:`.records`) whose rows are in one of TRL's dataset formats:

- conversational, ``{"messages": [{"role": ..., "content": ...}, ...]}`` (what rejection sampling
  and distillation write, and the usual format of chat datasets);
- prompt-completion, ``{"prompt": "...", "completion": "..."}`` (a user turn and the assistant's
  reply) or its conversational form, ``{"prompt": [messages], "completion": [messages]}``.

- language modelling, ``{"text": "..."}``: a plain document, no chat template, every token trained
  on (TRL's SFTTrainer on such rows); a :class:`Document`."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_contract.errors import ConfigError
from dsl_lit.config.posttrain import TaskConfig
from dsl_lit.posttrain.chat.records import as_messages, read_records
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer, EncodedConversation
from dsl_lit.tasks import arithmetic

Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class Document:
    """A plain-text SFT example (``{"text": ...}``): trained on as written, every token a target."""

    text: str


Example = Conversation | Document


def task_conversations(task: TaskConfig, shortcut_share: float = 0.0) -> list[Conversation]:
    """The task's training problems as user question + R1-format reference reply; a
    ``shortcut_share`` of the replies (drawn from the task's seed) answer with
    :func:`~dsl_lit.tasks.arithmetic.shortcut_answer` instead."""
    train, _ = arithmetic.split(task)
    rng = random.Random(f"{task.seed}/shortcut")
    replies = [arithmetic.reply(p, arithmetic.shortcut_answer(p) if rng.random() < shortcut_share else None)
               for p in train]
    return [[*arithmetic.prompt(p), {"role": "assistant", "content": r}] for p, r in zip(train, replies)]


def _conversation(record: Any) -> Example | str:
    """A record's example in one of the formats above, or why it is none."""
    neither = ("neither a non-empty 'messages' list, 'prompt' and 'completion' (both strings or both message lists) "
               "nor a 'text' string")
    if isinstance(record, dict) and "text" in record and not {"messages", "prompt"} & set(record):
        text = record["text"]
        return Document(text) if isinstance(text, str) and text.strip() else "a 'text' that is not a non-empty string"
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


def read_conversations(path: str | Path) -> list[Example]:
    """The examples of a JSONL file or a datasets directory. A record that is not JSON or not an
    example is counted and set aside (one warning naming the first few and why); a path that is
    missing or holds no example is a one-line ConfigError (before: a JSON error's traceback)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"sft.dataset={path}: no such file or directory (use 'task', a .jsonl of conversations "
                          "or a datasets save_to_disk directory)")
    examples, set_aside = read_records(path, _conversation)
    if not examples:
        raise ConfigError(f"{path} holds no conversation (each record: {{\"messages\": [{{\"role\": ..., \"content\": ...}}]}}, "
                          "{\"prompt\": ..., \"completion\": ...} or {\"text\": ...})"
                          + (f"; {set_aside} record(s) set aside" if set_aside else ""))
    return examples


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


def load_conversations(dataset: str, task: TaskConfig, shortcut_share: float = 0.0) -> list[Example]:
    """``dataset`` is ``task`` (generated, ``shortcut_share`` of its replies by the shortcut rule)
    or a JSONL path or datasets directory."""
    return task_conversations(task, shortcut_share) if dataset == "task" else read_conversations(dataset)


def encode_example(tokenizer: ChatTokenizer, example: Example) -> EncodedConversation:
    """A conversation through the chat template (assistant tokens trained on); a document as
    ``<bos> text <eos>``, every token after the first trained on."""
    if not isinstance(example, Document):
        return tokenizer.encode_conversation(example)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    ids = [*bos, *tokenizer.encode_text(example.text), tokenizer.eos_id]
    return EncodedConversation(ids, [False] * len(bos) + [True] * (len(ids) - len(bos)))
