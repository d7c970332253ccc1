"""A tokenizer's Jinja chat template, rendered as ``transformers``' ``apply_chat_template`` renders it,
and the characters of the render that the assistant wrote.

Why render ourselves: the text a model was trained on is whatever its released template makes of a
conversation (DeepSeek-V3's role tokens, R1's template dropping the ``<think>`` reasoning of
assistant turns, tool calls); SFT rows must be exactly that text, so the template is executed with
the environment transformers gives it (sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, loop
controls, ``raise_exception``, ``tojson``, ``strftime_now``) without importing transformers.
Messages are passed as they are, None values included: V3's template renders an assistant message
whose content is None as its tool calls (transformers 5 drops None-valued keys first, and then
cannot render those).

Why spans by difference: templates rewrite content (strip reasoning, prefix tool calls) and may
render one message differently depending on what follows, so the assistant's characters cannot be
found by rendering prefixes. Instead each assistant message is rendered once more with its
content replaced by one sentinel character: the render differs from the real one exactly where
the template put that message's (rewritten) output, and the template's end-of-sentence token that
follows it belongs to the assistant too (it is what makes the model stop).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]
Span = tuple[int, int]
# Fields an assistant message's output may live in besides ``content``: replaced along with it.
OUTPUT_FIELDS = ("tool_calls", "reasoning_content", "reasoning", "thinking")
_SENTINELS = [chr(c) for c in range(0xE000, 0xE100)]  # private-use characters


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON without HTML escaping, as templates expect (Jinja's own filter escapes ``<>&'``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The compiled template (cached: a dataset renders the same template many times)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """``source`` rendered with the tokenizer's special tokens (``bos_token``, ``eos_token``, ...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        self.source = source
        self.template = compile_template(source)
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.eos_token = self.special_tokens.get("eos_token")

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation's text; ``ValueError`` when the template refuses it."""
        try:
            return self.template.render(messages=[dict(m) for m in messages],
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except TemplateError as error:
            raise ValueError(f"the chat template refused the conversation: {error}") from error

    def assistant_spans(self, messages: Sequence[Message], text: str | None = None) -> list[Span]:
        """``[start, end)`` character ranges of ``text`` (the render of ``messages``) that the
        assistant messages produced, each followed by the end-of-sentence token the template puts
        after it; an assistant message the template does not show has no span."""
        text = self.render(messages) if text is None else text
        sentinel = next(s for s in _SENTINELS if s not in text)
        spans = []
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            blank = {key: v for key, v in message.items() if key not in OUTPUT_FIELDS} | {"content": sentinel}
            other = self.render([*messages[:k], blank, *messages[k + 1:]])
            if sentinel not in other:
                continue
            start = _common_prefix(text, other)
            end = len(text) - _common_prefix(text[start:][::-1], other[start:][::-1])
            if self.eos_token and text.startswith(self.eos_token, end):
                end += len(self.eos_token)
            if end > start:
                spans.append((start, end))
        return spans


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
