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

import functools
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import Environment, TemplateError
from jinja2.exceptions import SecurityError
from jinja2.ext import loopcontrols
from jinja2.nodes import EvalContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dsl_lit.config.errors import ConfigError

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


MAX_RENDER_SECONDS = 5.0
"""Wall time one conversation's render may take (a released template renders in ~1 ms)."""
MAX_RENDER_CHARS = 4_000_000
"""Characters one render may produce, and the largest string or list ``*`` may build."""
MAX_RANGE_ITEMS = 1_000_000
"""Elements all ``range`` calls of one render may produce together (nested loops multiply)."""
MAX_POWER_BITS = 4096
"""The largest integer ``**`` may build (in bits)."""


class TemplateLimitError(TemplateError):
    """A render went past one of the bounds above."""


class _Budget(threading.local):
    """The bounds of the render running on this thread."""

    deadline = 0.0
    range_items = 0

    def start(self) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.range_items = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the render ran longer than {MAX_RENDER_SECONDS:g} s")


_budget = _Budget()


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the bounds a template run on untrusted data needs: time
    (checked on every call, attribute and item access, and output chunk), ``range`` items,
    ``**`` and sequence ``*`` sizes (intercepted, so never folded at compile time either)."""

    intercepted_binops = frozenset(["*", "**", "+"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _budget.check_time()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError(f"{left} ** {right} would exceed {MAX_POWER_BITS} bits")
        if operator == "*" and ints and abs(left).bit_length() + abs(right).bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError(f"a product of integers would exceed {MAX_POWER_BITS} bits")
        if operator in ("*", "+"):
            size = _result_size(operator, left, right)
            if size > MAX_RENDER_CHARS:
                raise TemplateLimitError(f"{type(left).__name__} {operator} {type(right).__name__} would hold {size} "
                                         f"characters or items, more than {MAX_RENDER_CHARS}")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        _budget.check_time()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget.check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget.check_time()
        return super().getitem(obj, argument)


def _size(value: Any) -> int:
    """Characters of a string; for a list or tuple, the characters of its strings (a list of huge
    strings is small until joined)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(len(v) if isinstance(v, str) else 1 for v in value)
    return 0


def _result_size(operator: str, left: Any, right: Any) -> int:
    if operator == "+":
        return _size(left) + _size(right)
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            return _size(seq) * max(n, 0)
    return 0


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _format_widths(spec: Any) -> int:
    """The largest number written in a ``%``-format string (``'%1000000000d'`` pads that wide)."""
    return max((int(n) for n in re.findall(r"\d+", spec)), default=0) if isinstance(spec, str) else 0


_FILTER_SIZES: dict[str, Any] = {
    # upper bounds of the result's length from the filter's arguments (value first)
    "center": lambda v, width=80, *_: max(_size(v), _int(width)),
    "format": lambda v, *args, **kw: _size(v) + _format_widths(v) + sum(len(str(a)) for a in (*args, *kw.values())),
    "join": lambda v, d="", *_: _size(list(v) if isinstance(v, (list, tuple)) else v) + len(str(d)) * len(v),
    "indent": lambda v, width=4, *_: _size(v) + (str(v).count("\n") + 1) * (
        _int(width) if isinstance(width, int) else len(str(width))),
    "replace": lambda v, old="", new="", *_: _size(v) + (_size(v) + 1) * len(str(new)),
    "wordwrap": lambda v, *_: 2 * _size(v),
}


def _bounded_filter(name: str, filter_fn: Any) -> Any:
    """Jinja's ``name`` filter, refusing a result longer than :data:`MAX_RENDER_CHARS` before it is
    built (``center``, ``format``, ``join``, ``indent``, ``replace`` make a huge string in one call)."""
    estimate = _FILTER_SIZES[name]

    @functools.wraps(filter_fn)  # keeps jinja_pass_arg: Jinja passes the same first argument
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _budget.check_time()
        # join and replace take Jinja's eval context first, wordwrap its environment
        first = 1 if args and isinstance(args[0], (EvalContext, Environment)) else 0
        if len(args) > first and not isinstance(args[first], (str, list, tuple, dict)) and hasattr(args[first], "__iter__"):
            args = (*args[:first], list(args[first]), *args[first + 1:])  # a generator (map, select): read once
        values = args[first:]
        size = estimate(*values, **kwargs) if values else 0
        if size > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"the {name} filter would build up to {size} characters, more than "
                                     f"{MAX_RENDER_CHARS}")
        return filter_fn(*args, **kwargs)

    return bounded


def _bounded_range(*args: int) -> range:
    items = range(*args)
    _budget.range_items += len(items)
    if _budget.range_items > MAX_RANGE_ITEMS:
        raise TemplateLimitError(f"range() produced more than {MAX_RANGE_ITEMS} items in one render")
    return items


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The compiled template (cached: a dataset renders the same template many times)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    for name in _FILTER_SIZES:
        if name in env.filters:
            env.filters[name] = _bounded_filter(name, env.filters[name])
    return env.from_string(source)


def render_bounded(source: str, origin: str, **values: Any) -> str:
    """``source`` rendered over ``values`` in the bounded sandbox (ConfigError naming ``origin``
    when it breaks a bound or fails): for templates from files a user names."""
    _budget.start()
    try:
        out = compile_template(source).render(**values)
    except (TemplateError, RecursionError, MemoryError) as error:
        raise ConfigError(f"{origin}: the template {source[:60]!r} failed: {type(error).__name__}: {error}") from None
    if len(out) > MAX_RENDER_CHARS:
        raise ConfigError(f"{origin}: the template {source[:60]!r} rendered more than {MAX_RENDER_CHARS} characters")
    return out


class ChatTemplate:
    """``source`` rendered with the tokenizer's special tokens (``bos_token``, ``eos_token``, ...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None], origin: str = "the chat template") -> None:
        self.source = source
        self.origin = origin
        """Where the template came from (a file), for errors."""
        try:
            self.template = compile_template(source)
        except TemplateError as error:  # syntax errors: one line naming the file
            raise ConfigError(f"{origin}: the chat template does not compile: {error}") from None
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.eos_token = self.special_tokens.get("eos_token")

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation's text; ``ValueError`` when the template refuses it (``raise_exception``),
        ConfigError when it breaks a bound or fails (the template, not the conversation, is at fault)."""
        _budget.start()
        size = 0
        chunks = []
        try:
            for chunk in self.template.generate(messages=[dict(m) for m in messages],
                                                add_generation_prompt=add_generation_prompt, **self.special_tokens):
                size += len(chunk)
                if size > MAX_RENDER_CHARS:
                    raise TemplateLimitError(f"the render exceeded {MAX_RENDER_CHARS} characters")
                _budget.check_time()
                chunks.append(chunk)
        except TemplateLimitError as error:
            raise ConfigError(f"{self.origin}: {error}; the chat template is refused") from None
        except TemplateError as error:
            if isinstance(error, SecurityError):
                raise ConfigError(f"{self.origin}: the sandbox blocked the chat template: {error}") from None
            raise ValueError(f"the chat template refused the conversation: {error}") from error
        except RecursionError:
            raise ConfigError(f"{self.origin}: the chat template recursed too deeply") from None
        except MemoryError:
            raise ConfigError(f"{self.origin}: the chat template ran out of memory rendering one conversation") from None
        return "".join(chunks)

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


def _common_prefix(a: str, b: str, block: int = 4096) -> int:
    """Length of the common prefix: whole blocks compared by C string comparison, then the
    characters of the first differing block (linear in the prefix, ~1,000x fewer Python steps than
    a character loop)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + block] == b[i : i + block]:
        i += block
    if i >= n:
        return n
    end = min(i + block, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i
