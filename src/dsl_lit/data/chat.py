"""DeepSeek's chat template, tokenized turn by turn so that we know which tokens are the model's.

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{reply}<｜end▁of▁sentence｜><｜User｜>...

Every turn is tokenized on its own and joined with the special-token ids, so a role tag can never
merge with neighbouring text and the loss mask (the assistant's replies and their end-of-sentence
token) follows turn boundaries exactly. R1's ``<think>``/``<answer>`` tags inside a reply are
special tokens of our tokenizer (``dsl_lit.data.format.DEEPSEEK_SPECIAL_TOKENS``), so they encode to one id each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from dsl_lit.data.format import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TOKENIZER_FILE, USER_TOKEN

ROLES = ("system", "user", "assistant")
Message = Mapping[str, str]


@dataclass
class EncodedConversation:
    ids: list[int]
    """Token ids of the whole conversation."""
    trained: list[bool]
    """Per token: is it a target of the loss (assistant reply tokens and their end-of-sentence)."""


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids of the template's special tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = {name: tokenizer.token_to_id(token) for name, token in (
            ("bos", BOS_TOKEN), ("eos", EOS_TOKEN), ("pad", PAD_TOKEN), ("user", USER_TOKEN),
            ("assistant", ASSISTANT_TOKEN))}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"the tokenizer has no special token(s) for {missing}; train it with "
                             "data_pipeline.train_tokenizer (DeepSeek's 15 special tokens)")
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
        self.user_id, self.assistant_id = ids["user"], ids["assistant"]

    @classmethod
    def from_dir(cls, directory: str | Path) -> ChatTokenizer:
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: point tokenizer_dir at a directory with tokenizer.json")
        return cls(Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with the reasoning tags kept, end-of-sentence and padding dropped."""
        kept = [i for i in ids if i not in (self.eos_id, self.pad_id)]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def encode_conversation(self, messages: Sequence[Message]) -> EncodedConversation:
        """The template over ``messages`` (an optional leading system message, then user and
        assistant turns alternating); assistant turns are trained on."""
        ids, trained = [self.bos_id], [False]
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content", "")
            if role not in ROLES or (role == "system" and i):
                raise ValueError(f"message {i} has role {role!r}; expected an optional first system "
                                 "message, then user/assistant turns")
            if role == "assistant":
                reply = self.encode_text(content) + [self.eos_id]
                ids += reply
                trained += [True] * len(reply)
                continue
            turn = ([self.user_id] if role == "user" else []) + self.encode_text(content)
            if role == "user":
                turn.append(self.assistant_id)
            ids += turn
            trained += [False] * len(turn)
        return EncodedConversation(ids, trained)

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Ids of a conversation ending in a user turn, up to and including ``<｜Assistant｜>``:
        what generation continues from."""
        if not messages or messages[-1].get("role") != "user":
            raise ValueError("a prompt must end with a user message")
        return self.encode_conversation(messages).ids


def prompt_and_reply(prompt: Sequence[Message], reply: str) -> list[dict[str, Any]]:
    """The conversation of a prompt followed by one assistant reply."""
    return [*map(dict, prompt), {"role": "assistant", "content": reply}]
