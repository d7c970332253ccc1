"""Conversations -> token ids and the loss mask, through the tokenizer's own chat template.

A released tokenizer carries the template its model was trained with (``chat_template`` in
tokenizer_config.json, or chat_template.jinja): the conversation is rendered with it exactly as
``transformers``' ``apply_chat_template`` renders it, and encoded as a whole, so the ids equal
``apply_chat_template(messages, tokenize=True)``. Tokens are trained on where they overlap what the
assistant wrote (``data_contract.chat_template``): its replies as the template shows them (R1's
template drops the ``<think>`` reasoning of assistant turns; V3's keeps it) and the
end-of-sentence token after each. A tokenizer without a template (the bundled demo tokenizer) gets
DeepSeek's format, written here:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{reply}<｜end▁of▁sentence｜><｜User｜>...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from data_contract.chat_template import ChatTemplate, Span
from data_contract.format import ASSISTANT_TOKEN, TOKENIZER_FILE, USER_TOKEN
from data_contract.tokenizer_dir import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    chat_template,
    special_tokens,
    validate_tokenizer_dir,
)

Message = Mapping[str, Any]

DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}{{ message['content'] }}"
    f"{{% elif message['role'] == 'user' %}}{{{{ '{USER_TOKEN}' + message['content'] + '{ASSISTANT_TOKEN}' }}}}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('message ' ~ loop.index0 ~ ' has role ' ~ message['role'] ~ '; expected an "
    "optional first system message, then user/assistant turns') }}"
    "{% endif %}{% endfor %}"
)
"""The format of the bundled tokenizer (no template of its own): DeepSeek-V3's without tools. The
user turn ends in ``<｜Assistant｜>``, so a prompt is the same with or without a generation prompt."""


@dataclass
class EncodedConversation:
    ids: list[int]
    """Token ids of the whole conversation."""
    trained: list[bool]
    """Per token: is it a target of the loss (assistant reply tokens and their end-of-sentence)."""


def _overlaps(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[bool]:
    """Per token: does its character range overlap a span (a token the template split across a span
    boundary, like ``" Hello"`` after ``"Assistant:"``, is the assistant's)."""
    flags, s = [], 0
    for start, end in offsets:
        while s < len(spans) and spans[s][1] <= start:
            s += 1
        flags.append(s < len(spans) and spans[s][0] < max(end, start + 1))
    return flags


class ChatTokenizer:
    """A ``tokenizers.Tokenizer``, its ids, and the chat template its conversations are rendered with."""

    def __init__(self, tokenizer: Tokenizer, meta: Mapping[str, Any], tokens: Mapping[str, str | None],
                 template: str | None = None, origin: str = "the chat template") -> None:
        self.tokenizer = tokenizer
        self.meta = dict(meta)
        self.bos_id, self.eos_id, self.pad_id = meta.get("bos_id"), int(meta["eos_id"]), int(meta["pad_id"])
        self.has_own_template = template is not None
        if template is None and tokens.get("bos_token") is None:
            raise ValueError("the tokenizer has neither a chat template nor a bos token for DeepSeek's format")
        self.template = ChatTemplate(template or DEEPSEEK_TEMPLATE, tokens,
                                     origin if template is not None else "the built-in DeepSeek chat format")

    @classmethod
    def from_dir(cls, directory: str | Path, template_name: str | None = None) -> ChatTokenizer:
        """Our pipeline's tokenizer/ or a released one (tokenizer.json + tokenizer_config.json);
        ``template_name`` picks one of its named chat templates (None: its default)."""
        meta = validate_tokenizer_dir(directory, "tokenizer_dir")
        directory = Path(directory)
        from_file = template_name is None and (directory / CHAT_TEMPLATE_FILE).is_file()
        origin = str(directory / (CHAT_TEMPLATE_FILE if from_file else TOKENIZER_CONFIG))
        return cls(Tokenizer.from_file(str(directory / TOKENIZER_FILE)), meta,
                   special_tokens(directory), chat_template(directory, template_name), origin)

    @property
    def vocab_size(self) -> int:
        """Ids the model must embed (the largest id + 1)."""
        return int(self.meta["vocab_size"])

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with the reasoning tags kept, end-of-sentence and padding dropped."""
        kept = [i for i in ids if i not in (self.eos_id, self.pad_id)]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def encode_conversation(self, messages: Sequence[Message]) -> EncodedConversation:
        """The template over ``messages``; the assistant's tokens are trained on."""
        text = self.template.render(messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        trained = _overlaps(encoding.offsets, self.template.assistant_spans(messages, text))
        return EncodedConversation(list(encoding.ids), trained)

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Ids of a conversation not ending in an assistant turn, with the template's generation
        prompt (``<｜Assistant｜>``): what generation continues from."""
        if not messages or messages[-1].get("role") == "assistant":
            raise ValueError("a prompt must end with a user message")
        return self.encode_text(self.template.render(messages, add_generation_prompt=True))


def prompt_and_reply(prompt: Sequence[Message], reply: str) -> list[dict[str, Any]]:
    """The conversation of a prompt followed by one assistant reply."""
    return [*map(dict, prompt), {"role": "assistant", "content": reply}]
