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
import re
import string
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, TemplateNotFound, nodes, pass_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.ext import loopcontrols
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, generate_lorem_ipsum

from data_contract.errors import ConfigError
from data_contract.tokenizer_dir import token_string

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
MAX_RENDER_STEPS = 1_000_000
"""Steps one render may take: loop iterations, calls, operators, attribute and item lookups,
filters, tests and outputs (a released template takes ~30 a message). Counted, not timed, so the
bound is the same on a loaded machine; a step is well under a microsecond."""
MAX_RENDER_CHARS = 4_000_000
"""Characters one render may produce, and the size of the largest value any operation may build
(a string's characters; a list, tuple or dict counts what it holds, shared parts each time they
appear, plus 8 per item)."""
MAX_BUILT_CHARS = 16_000_000
"""The sizes of all the values the operations of one render build, together (at most a few times
the conversation for a released template)."""
MAX_RANGE_ITEMS = 1_000_000
"""Elements all ``range`` calls of one render may produce together (nested loops multiply)."""
MAX_POWER_BITS = 4096
"""The largest integer ``**`` and ``*`` may build (in bits)."""
_ITEM = 8
"""What one item of a list, tuple or dict adds to its size (a pointer's bytes)."""


class TemplateLimitError(TemplateError):
    """A render went past one of the bounds above."""


# -- the budget of the render running on this thread ------------------------------------------------


class _Budget:
    """Steps, time and what one render has built. Outside a render (while compiling, when Jinja
    evaluates constant output) the idle budget counts nothing; sizes are checked all the same."""

    _CHECK_EVERY = 1024
    """Steps between two looks at the clock (reading it costs more than a step)."""

    def __init__(self, active: bool = False) -> None:
        self.active = active
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.max_steps = MAX_RENDER_STEPS
        self.steps = self.range_items = self.built = 0
        self.next_check = min(self._CHECK_EVERY, self.max_steps) if active else float("inf")
        self.sizes: dict[int, tuple[Any, int]] = {}
        """id -> (container, size): each container measured once a render (kept alive meanwhile, so
        its id is not reused)."""

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.next_check:
            if self.steps > self.max_steps:
                raise TemplateLimitError(f"the render took more than {self.max_steps} steps (loop iterations, "
                                         "calls, lookups, filters)")
            self.check_time()
            self.next_check = min(self.steps + self._CHECK_EVERY, self.max_steps)

    def check_time(self) -> None:
        if self.active and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the render ran longer than {MAX_RENDER_SECONDS:g} s")


_IDLE = _Budget()
_local = threading.local()


def _budget() -> _Budget:
    """The budget of the render running on this thread."""
    return getattr(_local, "budget", _IDLE)


def _measure(value: Any, limit: int = MAX_RENDER_CHARS) -> int:
    """``value``'s size: characters of a string or bytes; for a container, the sizes of what it holds
    (a part held twice counts twice: that is what printing or comparing it costs) plus
    :data:`_ITEM` an item; 1 for anything else. Stops counting past ``limit``."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 1  # about its decimal digits
    if isinstance(value, Namespace):  # mutable: not remembered
        return _measure(object.__getattribute__(value, "_Namespace__attrs"), limit)
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        return 1
    budget = _budget()
    known = budget.sizes.get(id(value))
    if known is not None and known[0] is value:
        return known[1]
    total = _ITEM * len(value)
    for item in (value.items() if isinstance(value, dict) else value):
        total += _measure(item, limit - total)
        if total > limit:
            return total
    if budget.active:
        budget.sizes[id(value)] = (value, total)
    return total


def _text_size(value: Any) -> int:
    """An upper bound of ``len(str(value))`` (and of its ``repr``) without building it."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (bytes, bytearray)):
        return 4 * len(value) + 3
    if isinstance(value, (int, float)) or value is None:
        return _measure(value) + 24
    return 6 * _measure(value) + 64


def _refuse(what: str, size: int) -> None:
    if size > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"{what} would hold {size} characters or items, more than {MAX_RENDER_CHARS}")


def _admit(value: Any, what: str) -> Any:
    """``value``, just built by ``what``, counted: refused when it is too large, or when what the render
    has built comes to more than :data:`MAX_BUILT_CHARS`. An iterator is counted item by item as it
    is read. Callers pass a local variable: a value with no other reference is new (one that
    was already there, such as a message's content, is not counted again)."""
    if type(value) is str:
        size = len(value)
    elif hasattr(value, "__next__"):
        return _counted_iterator(value, what)
    else:
        size = _measure(value)
    _refuse(what, size)
    budget = _budget()
    if budget.active and sys.getrefcount(value) <= 3:  # the caller's name, ours, getrefcount's
        budget.built += size
        if budget.built > MAX_BUILT_CHARS:
            raise TemplateLimitError(f"the render built more than {MAX_BUILT_CHARS} characters or items in all")
    return value


def _counted_iterator(items: Iterator[Any], what: str) -> Iterator[Any]:
    for item in items:
        _budget().step()
        yield _admit(item, what)


class _Counted:
    """A ``for`` loop's iterable, one step an iteration (its length kept for ``loop.length``)."""

    __slots__ = ("items",)

    def __init__(self, items: Any) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)  # TypeError without one: LoopContext then counts the items itself

    def __iter__(self) -> Iterator[Any]:
        step = _budget().step  # one render, one thread
        for item in self.items:
            step()
            yield item


_LOOP_FILTER = "bounded_loop"
"""The filter every ``for`` loop's iterable is passed through (added at parse time)."""


# -- upper bounds of results, from arguments ---------------------------------------------------------


def _count(text: str) -> int:
    """A number written in a format string (a width or precision); more than any bound when huge."""
    return int(text) if len(text) < 12 else 10**12


def _ints(values: Iterable[Any]) -> int:
    """The largest integer among ``values`` (a width may come from the arguments: ``'%*d'``, ``'{:{}}'``)."""
    return max((abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def _percent_size(fmt: str | bytes, values: Any) -> int:
    """``fmt % values``: the format, and for each conversion its width, precision and the longest argument."""
    fmt_text = fmt.decode("latin-1") if isinstance(fmt, (bytes, bytearray)) else fmt
    args = list(values.values()) if isinstance(values, dict) else list(values) if isinstance(values, tuple) else [values]
    big, longest = _ints(args), max((_text_size(a) for a in args), default=0)
    total = len(fmt_text)
    for width, precision, conversion in _PERCENT_SPEC.findall(fmt_text):
        if conversion != "%":
            total += longest + sum(big if part == "*" else _count(part) if part else 0 for part in (width, precision))
    return total


def _brace_size(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """``fmt.format(*args, **kwargs)``: the format, and for each field the longest argument and the
    numbers of its spec (a nested ``{}`` in a spec: the largest integer argument)."""
    values = [*args, *kwargs.values()]
    big, longest = _ints(values), max((_text_size(a) for a in values), default=0)
    total = len(fmt)
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return total  # the call raises the same error
    for _, name, spec, _ in fields:
        if name is not None:
            spec = spec or ""
            total += longest + sum(_count(n) for n in re.findall(r"\d+", spec)) + (big if "{" in spec else 0)
    return total


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], position: int, name: str, default: Any) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


def _int_arg(args: Sequence[Any], kwargs: Mapping[str, Any], position: int, name: str, default: int) -> int:
    value = _arg(args, kwargs, position, name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _replace_size(s: Any, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(s, (str, bytes)) and type(old) is type(new) is type(s)):
        return _measure(s)
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _join_size(separator: Any, items: Any) -> int:
    items = list(items) if isinstance(items, (list, tuple, dict, set, frozenset, str)) else []
    return sum(_text_size(i) for i in items) + _text_size(separator) * max(len(items) - 1, 0)


def _translate_size(s: Any, table: Any) -> int:
    longest = max((_measure(v) for v in table.values()), default=1) if isinstance(table, dict) else 1
    return len(s) * max(longest, 1)


def _pieces(s: Any, sep: Any) -> int:
    """Items ``split`` may make of ``s``."""
    return s.count(sep) + 1 if isinstance(sep, type(s)) and sep else len(s) // 2 + 1


# What each method of a string (or bytes, or a number) may build, from its arguments: the methods
# whose result can be far larger than their inputs. The others build at most three times their
# string (``'ß'.upper()`` is ``'SS'``) and are listed in _METHODS_WITHIN_INPUT; a method in neither
# (a newer Python's) is refused.
_METHOD_SIZES: dict[str, Any] = {
    "center": lambda s, a, k: max(len(s), _int_arg(a, k, 0, "width", 0)),
    "ljust": lambda s, a, k: max(len(s), _int_arg(a, k, 0, "width", 0)),
    "rjust": lambda s, a, k: max(len(s), _int_arg(a, k, 0, "width", 0)),
    "zfill": lambda s, a, k: max(len(s), _int_arg(a, k, 0, "width", 0)),
    "expandtabs": lambda s, a, k: len(s) + s.count(b"\t" if isinstance(s, bytes) else "\t")
    * max(_int_arg(a, k, 0, "tabsize", 8), 0),
    "replace": lambda s, a, k: _replace_size(s, _arg(a, k, 0, "old", ""), _arg(a, k, 1, "new", ""),
                                             _arg(a, k, 2, "count", -1)),
    "join": lambda s, a, k: _join_size(s, _arg(a, k, 0, "iterable", ())),
    "format": lambda s, a, k: _brace_size(s, a, k),
    "format_map": lambda s, a, k: _brace_size(s, (), a[0] if a and isinstance(a[0], Mapping) else {}),
    "translate": lambda s, a, k: _translate_size(s, _arg(a, k, 0, "table", None)),
    "split": lambda s, a, k: len(s) + _ITEM * _pieces(s, _arg(a, k, 0, "sep", None)),
    "rsplit": lambda s, a, k: len(s) + _ITEM * _pieces(s, _arg(a, k, 0, "sep", None)),
    "splitlines": lambda s, a, k: len(s) + _ITEM * (len(s) + 1),
    "partition": lambda s, a, k: len(s) + 3 * _ITEM,
    "rpartition": lambda s, a, k: len(s) + 3 * _ITEM,
    "encode": lambda s, a, k: 4 * len(s),
    "hex": lambda s, a, k: len(s) * (2 + len(str(_arg(a, k, 0, "sep", "")))),
    "to_bytes": lambda n, a, k: _int_arg(a, k, 0, "length", 1),
}
_METHODS_WITHIN_INPUT = frozenset({
    # str, bytes and markupsafe.Markup
    "capitalize", "casefold", "count", "decode", "endswith", "escape", "find", "fromhex", "index", "isalnum",
    "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric", "isprintable",
    "isspace", "istitle", "isupper", "lower", "lstrip", "maketrans", "removeprefix", "removesuffix", "rfind",
    "rindex", "rstrip", "startswith", "strip", "striptags", "swapcase", "title", "unescape", "upper",
    # int, float, bool
    "as_integer_ratio", "bit_count", "bit_length", "conjugate", "from_bytes", "is_integer",
})
_SCALARS = (str, bytes, bytearray, int, float)


def _call_size(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """An upper bound of what calling ``target`` builds (0: it builds nothing of note or is template code)."""
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, _SCALARS):
        return 0
    name = getattr(target, "__name__", "")
    if name in _METHOD_SIZES:
        return _METHOD_SIZES[name](owner, args, kwargs)
    if name not in _METHODS_WITHIN_INPUT:
        raise TemplateLimitError(f"{type(owner).__name__}.{name} is not a method the template sandbox knows the "
                                 "cost of")
    if _ints([*args, *kwargs.values()]) > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"{type(owner).__name__}.{name} was given an integer over {MAX_RENDER_CHARS}")
    return 3 * _measure(owner) + sum(_measure(a) for a in (*args, *kwargs.values()))


def _binop_size(operator: str, left: Any, right: Any) -> int:
    if operator == "+" and not (isinstance(left, (int, float)) and isinstance(right, (int, float))):
        return _measure(left) + _measure(right)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                return _measure(seq) * max(n, 0)
    if operator == "%" and isinstance(left, (str, bytes)):
        return _percent_size(left, right)
    return 0


# -- filters, globals --------------------------------------------------------------------------------


def _lines(value: Any) -> int:
    return str(value).count("\n") + 1 if isinstance(value, str) else 1


def _depth(value: Any, limit: int = 64) -> int:
    if limit and isinstance(value, (list, tuple, dict)) and value:
        return 1 + max(_depth(v, limit - 1) for v in (value.values() if isinstance(value, dict) else value))
    return 0


def _json_size(value: Any, indent: Any = None, separators: Any = None, **_: Any) -> int:
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) and indent > 0 else 0
    seps = sum(len(str(s)) for s in separators) if isinstance(separators, (list, tuple)) else 2
    return _text_size(value) * (1 + seps) + _measure(value) * (1 + width * (_depth(value) + 1))


# Upper bounds of what a filter builds (value first, then its arguments), for the filters whose
# result can be far larger than their inputs; the others (_FILTERS_WITHIN_INPUT) build at most a
# few times their input. Each is also charged steps for the Python-level work it does per item or
# character (_FILTER_STEPS): a filter is one call, not checked while it runs.
_FILTER_SIZES: dict[str, Any] = {
    "center": lambda v, width=80, *_: max(_text_size(v), _int(width)),
    "format": lambda v, *args, **kw: _percent_size(v, kw or tuple(args)) if isinstance(v, str) else (
        _text_size(v) + _text_size(kw or args)),
    "join": lambda v, d="", *_, **__: _join_size(d, v),
    "indent": lambda v, width=4, *_, **__: _text_size(v) + _lines(v) * (
        _int(width) if isinstance(width, int) else len(str(width))),
    "replace": lambda v, old="", new="", count=None: _replace_size(v, old, new, count) if isinstance(v, str) else (
        _text_size(v) * (1 + _text_size(new))),
    "wordwrap": lambda v, width=79, brk=True, wrapstring=None, *_, **__: _text_size(v) * (
        1 + len(wrapstring if isinstance(wrapstring, str) else "\n")),
    "truncate": lambda v, length=255, killwords=False, end="...", *_, **__: _text_size(v) + len(str(end)),
    "batch": lambda v, linecount, fill_with=None: 2 * _measure(v) + _ITEM * (
        _int(linecount) if fill_with is not None else 0),
    "slice": lambda v, slices, fill_with=None: 2 * _measure(v) + 2 * _ITEM * _int(slices),
    "tojson": _json_size,
    "pprint": lambda v: _json_size(v, indent=1),
    "urlize": lambda v, trim_url_limit=None, nofollow=False, target=None, rel=None, *_, **__: 3 * _text_size(v) + (
        _text_size(v) // 2 + 1) * (80 + len(str(target or "")) + len(str(rel or ""))),
    "xmlattr": lambda v, *_: 6 * _text_size(v),
    "escape": lambda v: 6 * _text_size(v),
    "e": lambda v: 6 * _text_size(v),
    "forceescape": lambda v: 6 * _text_size(v),
    "urlencode": lambda v: 12 * _text_size(v),
    "string": lambda v: _text_size(v),
    "safe": lambda v: _text_size(v),
    "list": lambda v: _measure(v) + _ITEM * (len(v) if isinstance(v, (str, range)) else 0),
    "wordcount": lambda v: _text_size(v) + _ITEM * (_text_size(v) // 2 + 1),
    "sum": lambda v, attribute=None, start=0: _measure(v) + _measure(start),
    "title": lambda v: 3 * _text_size(v),
    "capitalize": lambda v: 3 * _text_size(v),
    "upper": lambda v: 3 * _text_size(v),
    "lower": lambda v: 3 * _text_size(v),
}
_FILTERS_WITHIN_INPUT = frozenset({
    "abs", "attr", "count", "d", "default", "dictsort", "filesizeformat", "first", "float", "groupby", "int",
    "items", "last", "length", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "round",
    "select", "selectattr", "sort", "striptags", "trim", "unique",
})
# The steps a filter's own Python loop costs (a step is about 0.3 us; measured on Jinja 3.1): per item
# of its input, or per character for the filters that work word by word. (map, select, reject and
# the *attr filters call a filter, a test or a lookup per item: counted there, one step each.)
_FILTER_STEPS: dict[str, Any] = {
    **dict.fromkeys(("batch", "dictsort", "groupby", "max", "min", "slice", "sort", "sum", "unique", "xmlattr"),
                    lambda v: 4 * (len(v) if isinstance(v, Sized) else 0)),
    "pprint": lambda v: _measure(v) // 2,
    "title": lambda v: _text_size(v),
    "wordwrap": lambda v: 2 * _text_size(v),
    "urlize": lambda v: 4 * _text_size(v),
}


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


_FIRST_ARGUMENT: dict[_PassArg | None, Any] = {
    # what a filter or test marked pass_context / pass_eval_context / pass_environment takes first
    _PassArg.context: lambda context: (context,),
    _PassArg.eval_context: lambda context: (context.eval_ctx,),
    _PassArg.environment: lambda context: (context.environment,),
    None: lambda context: (),
}


def _bounded_filter(name: str, filter_fn: Any) -> Any:
    """Jinja's ``name`` filter, counted as a step (and the per-item work of :data:`_FILTER_STEPS`),
    refusing before it runs a result larger than :data:`MAX_RENDER_CHARS` (:data:`_FILTER_SIZES`),
    and counting what it builds. A context filter, so that Jinja never runs it while compiling."""
    estimate, steps = _FILTER_SIZES.get(name), _FILTER_STEPS.get(name)
    first = _FIRST_ARGUMENT[_PassArg.from_obj(filter_fn)]
    label = f"the {name} filter"

    @pass_context
    def bounded(context: Any, value: Any = None, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        if (estimate or steps) and hasattr(value, "__next__"):
            value = list(value)  # a generator (map, select): read once, its items counted as they come
        if steps:
            budget.step(steps(value))
        if estimate:
            try:
                size = estimate(value, *args, **kwargs)
            except TypeError:  # arguments the filter itself refuses: let it say so
                size = 0
            _refuse(label, size)
        result = filter_fn(*first(context), value, *args, **kwargs)
        return _admit(result, label)

    bounded.__name__ = getattr(filter_fn, "__name__", name)
    return bounded


def _bounded_test(test_fn: Any) -> Any:
    """A Jinja test, counted as a step (and never run while compiling)."""
    first = _FIRST_ARGUMENT[_PassArg.from_obj(test_fn)]

    @pass_context
    def bounded(context: Any, *args: Any, **kwargs: Any) -> Any:
        _budget().step()
        return test_fn(*first(context), *args, **kwargs)

    return bounded


def _bounded_range(*args: int) -> range:
    items = range(*args)
    budget = _budget()
    budget.range_items += len(items)
    if budget.range_items > MAX_RANGE_ITEMS:
        raise TemplateLimitError(f"range() produced more than {MAX_RANGE_ITEMS} items in one render")
    return items


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
    """Jinja's ``lipsum``, refused before it runs when it would write more than the bound."""
    size = _int(n) * (_int(max) * 13 + 16)
    if size > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"lipsum(n={n}, max={max}) would build up to {size} characters, more than "
                                 f"{MAX_RENDER_CHARS}")
    _budget().step(_int(n) * _int(max) // 8)
    return generate_lorem_ipsum(n, html, min, max)


def _finalize(value: Any) -> Any:
    """Every ``{{ expression }}``: a step, and its text refused before it is made when too long."""
    _budget().step()
    _refuse("an expression's text", _text_size(value))
    return value


# -- the environment ---------------------------------------------------------------------------------


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``~`` and list, tuple and dict displays passed through the
    environment's bounds (Jinja's sandbox intercepts neither)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _admitted(self, visit: Any, node: nodes.Expr, frame: Frame) -> None:
        self.write("environment.admit_display(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._admitted(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._admitted(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "store":  # an assignment target: (a, b) = ...
            super().visit_Tuple(node, frame)
        else:
            self._admitted(super().visit_Tuple, node, frame)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with bounds on what a template run on untrusted data may allocate
    and how long it may run, whatever operation it uses.

    Every operation a template performs passes through here: calls (every method of every object,
    and the globals), all binary operators, ``~``, list/tuple/dict displays, attribute and item
    lookups, every filter and test, each ``{{ }}`` output, each iteration of each ``for`` loop, and
    the joining of captured output (macros, ``{% set %}`` blocks, filter blocks). Each is a step
    (:data:`MAX_RENDER_STEPS`, :data:`MAX_RENDER_SECONDS`); each that builds a value first bounds
    its size from its arguments where the result can be far larger than its inputs (the widths of
    ``ljust``/``center``/``zfill``/``%``/``format``, the counts of ``*``/``replace``/``join``/
    ``translate``/``expandtabs``, ``to_bytes``, ``lipsum``, ...) and refuses it before it is built
    (:data:`MAX_RENDER_CHARS`), then counts what it built (:data:`MAX_BUILT_CHARS`). A method of a
    string or number that the tables above do not know is refused. Constant folding is off, so
    nothing runs at compile time."""

    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
    code_generator_class = _BoundedCodeGenerator

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.iter.lineno)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _budget().step()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError(f"{left} ** {right} would exceed {MAX_POWER_BITS} bits")
        if operator == "*" and ints and abs(left).bit_length() + abs(right).bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError(f"a product of integers would exceed {MAX_POWER_BITS} bits")
        _refuse(f"{type(left).__name__} {operator} {type(right).__name__}", _binop_size(operator, left, right))
        result = super().call_binop(context, operator, left, right)
        return _admit(result, f"{type(left).__name__} {operator} {type(right).__name__}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        _budget().step()
        if isinstance(__obj, LoopContext) and args:  # loop(children) of a recursive loop: its iterations counted
            args = (_Counted(args[0]), *args[1:])
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        what = f"{getattr(target, '__qualname__', None) or type(target).__name__}()"
        if args and isinstance(args[0], Iterator) and getattr(target, "__name__", "") == "join":
            args = (list(args[0]), *args[1:])  # ''.join(generator): read once to be measured
        _refuse(what, _call_size(target, args, kwargs))
        result = super().call(__context, __obj, *args, **kwargs)
        return _admit(result, what)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().step()
        result = super().getitem(obj, argument)
        return _admit(result, "a slice") if isinstance(argument, slice) else result

    @staticmethod
    def concat(chunks: Iterable[str]) -> str:
        """Captured output joined (a macro's, a ``{% set %}`` block's, a filter block's): refused before
        joining when longer than the bound."""
        chunks = list(chunks)
        _budget().step()
        _refuse("captured output", sum(len(c) for c in chunks))
        result = "".join(chunks)
        return _admit(result, "captured output")

    @staticmethod
    def concat_values(values: tuple[Any, ...]) -> str:
        """``a ~ b ~ ...``: refused before any text is made when the result would be too long."""
        _budget().step()
        _refuse("~", sum(_text_size(v) for v in values))
        result = "".join(map(str, values))
        return _admit(result, "~")

    @staticmethod
    def admit_display(value: Any) -> Any:
        """A list, tuple or dict written in the template (``[a, a]``), measured."""
        _budget().step()
        return _admit(value, "a list, tuple or dict display")


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The compiled template (cached: a dataset renders the same template many times)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], optimized=False,
                         finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    env.globals["lipsum"] = _bounded_lipsum
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.filters[_LOOP_FILTER] = _Counted
    env.tests = {name: _bounded_test(fn) for name, fn in env.tests.items()}
    return env.from_string(source)


def _render(template: Any, values: Mapping[str, Any]) -> str:
    """``template`` over ``values`` within the bounds (TemplateLimitError past one)."""
    budget = _local.budget = _Budget(active=True)
    size = 0
    chunks = []
    try:
        for chunk in template.generate(**values):
            size += len(chunk)
            if size > MAX_RENDER_CHARS:
                raise TemplateLimitError(f"the render exceeded {MAX_RENDER_CHARS} characters")
            budget.check_time()
            chunks.append(chunk)
    finally:
        del _local.budget
    return "".join(chunks)


def render_bounded(source: str, origin: str, **values: Any) -> str:
    """``source`` rendered over ``values`` in the bounded sandbox (ConfigError naming ``origin``
    when it breaks a bound or fails): for templates from files a user names."""
    try:
        return _render(compile_template(source), values)
    except (TemplateError, RecursionError, MemoryError) as error:
        raise ConfigError(f"{origin}: the template {source[:60]!r} failed: {type(error).__name__}: "
                          f"{_one_line(error)}") from None


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]


SELF_CONTAINED = "a chat template must be one self-contained template (the sandbox loads no other file)"


def special_token(name: str, value: Any, origin: str) -> str:
    """A special token as the template sees it: a string, or the ``content`` of Hugging Face's
    ``AddedToken`` form (``{"content": "<s>", ...}``); anything else (a list) is one line naming it."""
    value = token_string(value)
    if not isinstance(value, str):
        raise ConfigError(f"{origin}: special token {name}={value!r} must be one string (or {{'content': ...}}), "
                          f"not a {type(value).__name__}")
    return value


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
        self.special_tokens = {k: special_token(k, v, origin) for k, v in special_tokens.items() if v is not None}
        self.eos_token = self.special_tokens.get("eos_token")

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation's text; ``ValueError`` when the template refuses it (``raise_exception``),
        ConfigError when it breaks a bound or fails (the template, not the conversation, is at fault)."""
        try:
            return _render(self.template, {"messages": [dict(m) for m in messages],
                                           "add_generation_prompt": add_generation_prompt, **self.special_tokens})
        except TemplateLimitError as error:
            raise ConfigError(f"{self.origin}: {error}; the chat template is refused") from None
        except TemplateNotFound as error:
            raise ConfigError(f"{self.origin}: the chat template includes or imports {error.name!r}: {SELF_CONTAINED}") from None
        except TemplateError as error:
            if isinstance(error, SecurityError):
                raise ConfigError(f"{self.origin}: the sandbox blocked the chat template: {_one_line(error)}") from None
            raise ValueError(f"the chat template refused the conversation: {error}") from error
        except RecursionError:
            raise ConfigError(f"{self.origin}: the chat template recursed too deeply") from None
        except MemoryError:
            raise ConfigError(f"{self.origin}: the chat template ran out of memory rendering one conversation") from None
        except (ArithmeticError, TypeError, AttributeError, LookupError) as error:  # the template's own code failed
            if "no loader" in str(error):  # jinja2's answer to {% include %} / {% import %} without a loader
                raise ConfigError(f"{self.origin}: the chat template includes or imports another file: {SELF_CONTAINED}") from None
            raise ConfigError(f"{self.origin}: the chat template failed: {type(error).__name__}: {_one_line(error)}") from None

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
