"""A word-level tokenizer of the passkey texts and a model that retrieves perfectly (or misses by
one token): what the passkey scoring and the in-training probe are tested against."""

from __future__ import annotations

import dataclasses

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn

from dsl_lit.tasks.passkey import CORPORA, KEY_LENGTH


def word_tokenizer() -> Tokenizer:
    """Every word, digit and punctuation mark of the passkey texts is one token."""
    texts = [t for corpus in CORPORA.values() for t in dataclasses.replace(corpus, documents=50).texts()]
    splitter = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.Punctuation()])
    words = sorted({w for text in texts for w, _ in splitter.pre_tokenize_str(text)})
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = splitter
    return tokenizer


class Retriever(nn.Module):
    """Logits of a model that retrieves perfectly: after the question's colon it writes the words
    that follow the first colon (or, with ``wrong``, the next ids in the vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, wrong: bool = False) -> None:
        super().__init__()
        self.colon, self.vocab, self.wrong = tokenizer.token_to_id(":"), tokenizer.get_vocab_size(), wrong

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, self.vocab)
        row = tokens[0].tolist()
        first, last = row.index(self.colon), len(row) - 1 - row[::-1].index(self.colon)
        for i in range(KEY_LENGTH):
            if last + i < len(row):
                logits[0, last + i, row[first + 1 + i] + (1 if self.wrong else 0)] = 1.0
        return logits
