"""SFT rows: conversations -> (input_ids, labels) rows, padded or packed.

Each conversation becomes one document ``input = ids[:-1]``, ``labels = ids[1:]`` with -100 where
the target is not the assistant's (prompt masking). Packing puts several documents into one row
of ``seq_len`` tokens (greedy, in order); then each row also carries

- ``positions``: every document's positions start at 0 (RoPE sees each as if it were alone);
- ``doc_ids``: the document of every token (-1 for padding), from which the model's attention mask
  lets a token see only earlier tokens of its own document (:func:`document_mask`).

Together they make a packed row compute exactly what its documents would compute one by one (the
packing-isolation test). Padded rows (``packing: false``) hold one document each and need neither,
which is what a pipeline-parallel run can feed (its stages see ``input_ids`` only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from data_contract.errors import ConfigError
from dsl_lit.posttrain.chat.tokenizer import EncodedConversation

log = logging.getLogger(__name__)
IGNORE = -100


def document(conversation: EncodedConversation, seq_len: int) -> tuple[list[int], list[int]]:
    """(inputs, labels) of one conversation, cut to ``seq_len`` tokens."""
    ids, trained = conversation.ids, conversation.trained
    inputs = ids[:-1][:seq_len]
    labels = [t if keep else IGNORE for t, keep in zip(ids[1:], trained[1:])][:seq_len]
    return inputs, labels


def padded_rows(docs: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One document per row, right-padded: ``input_ids``, ``labels`` [docs, seq_len]."""
    input_ids = torch.full((len(docs), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(docs), seq_len), IGNORE, dtype=torch.long)
    for i, (inputs, targets) in enumerate(docs):
        input_ids[i, : len(inputs)] = torch.tensor(inputs)
        labels[i, : len(targets)] = torch.tensor(targets)
    return {"input_ids": input_ids, "labels": labels}


def packed_rows(docs: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Documents packed greedily in order into rows of ``seq_len``: ``input_ids``, ``labels``,
    ``positions`` and ``doc_ids`` [rows, seq_len]. A document never spans two rows."""
    rows: list[list[tuple[list[int], list[int]]]] = [[]]
    used = 0
    for doc in docs:
        if used + len(doc[0]) > seq_len and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append(doc)
        used += len(doc[0])
    shape = (len(rows), seq_len)
    out = {
        "input_ids": torch.full(shape, pad_id, dtype=torch.long),
        "labels": torch.full(shape, IGNORE, dtype=torch.long),
        "positions": torch.zeros(shape, dtype=torch.long),
        "doc_ids": torch.full(shape, -1, dtype=torch.long),
    }
    for r, row in enumerate(rows):
        start = 0
        for d, (inputs, targets) in enumerate(row):
            end = start + len(inputs)
            out["input_ids"][r, start:end] = torch.tensor(inputs)
            out["labels"][r, start:end] = torch.tensor(targets)
            out["positions"][r, start:end] = torch.arange(len(inputs))
            out["doc_ids"][r, start:end] = d
            start = end
    log.info("sft: packed %d documents into %d rows of %d tokens (%.0f%% filled)", len(docs), len(rows), seq_len,
             100 * sum(len(d[0]) for d in docs) / (len(rows) * seq_len))
    return out


def check_targets(docs: Sequence[tuple[list[int], list[int]]], what: str) -> int:
    """Log the target (trainable) tokens of ``docs``; a ConfigError when there are none (a chat
    template that never shows the assistant's turns would train on nothing). Returns the count."""
    targets = [sum(t != IGNORE for t in labels) for _, labels in docs]
    log.info("%s: %d target (assistant) tokens in %d conversations", what, sum(targets), len(docs))
    if not sum(targets):
        raise ConfigError(
            f"{what}: none of the {len(docs)} conversations has a target token: the chat template renders no "
            "assistant turn (or data.seq_len cuts every conversation before it); check the template's assistant branch"
        )
    empty = sum(not t for t in targets)
    if empty:
        log.warning("%s: %d of %d conversations have no target token (their assistant turns are not rendered "
                    "or were cut) and only add context", what, empty, len(docs))
    return sum(targets)


def sft_rows(
    conversations: Sequence[EncodedConversation], seq_len: int, pad_id: int, packing: bool, split: str = "train"
) -> dict[str, torch.Tensor]:
    """The rows of ``split``'s conversations; a ConfigError when none of their tokens is a target
    (a chat template that never shows the assistant's turns would train on nothing)."""
    docs = [document(c, seq_len) for c in conversations]
    cut = sum(len(c.ids) - 1 > seq_len for c in conversations)
    if cut:
        log.warning("sft: %d of %d conversations are longer than data.seq_len=%d and were cut", cut, len(docs), seq_len)
    check_targets(docs, f"sft {split}")
    return packed_rows(docs, seq_len, pad_id) if packing else padded_rows(docs, seq_len, pad_id)


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, seq] bool: query i may attend key j of the same document (causality is added
    by the attention itself). Padding (-1) attends only padding."""
    return doc_ids[:, :, None] == doc_ids[:, None, :]
