"""Chat templates (and lm-eval ``doc_to_*`` templates) bounded by what they allocate and how long
they run, whatever operation they use (issue 41, item 4).

Before: ``'x'.ljust(2000000000)``, ``zfill``, ``center``, ``'%0...d' % 1``, ``'{:>...}'.format``,
``str.replace``, ``~``, ``translate``, ``(1).to_bytes(...)`` each allocated ~1.9 GB before the output
bound saw them (a chain 5.7 GB; ``%`` even at compile time, as constant folding); nested ``{% for %}``
over a string, ``lipsum(n=2000000)``, a list built by doubling (``[a, a]``) printed or compared, and
``urlize`` on a long text ran with no time check; a macro or ``{% set %}`` block looping over a long
string joined terabytes; ``sft.py`` hung on such a template and so did the data pipeline when it was in a
``decontaminate.eval_sets`` task YAML. Now each is a one-line ConfigError within a fraction of a
second, having allocated a few MB at most."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import tracemalloc

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import Markup

from data_contract import chat_template as ct
from data_contract.chat_template import ChatTemplate, compile_template, render_bounded
from data_contract.errors import ConfigError
from data_pipeline.stages.decontaminate import DecontaminateConfig, ngram_index
from tests.conftest import ROOT
from tests.forked_python import run_python

A = "{% set a = 'x' * 3999999 %}"
STEPS_OR_CLOCK = r"took more than 1000000 steps|ran longer than 5 s"
"""Where a render runs under the real clock (another process), the step bound or the 5 s deadline,
whichever a loaded machine reaches first: both stop it."""
PAYLOADS = {
    # a size argument a method or operator takes
    "ljust": ("{{ 'x'.ljust(2000000000) }}", r"str\.ljust\(\) would hold 2000000000 characters"),
    "rjust": ("{{ 'x'.rjust(2000000000) }}", r"str\.rjust\(\) would hold"),
    "zfill": ("{{ 'x'.zfill(2000000000) }}", r"str\.zfill\(\) would hold"),
    "center": ("{{ 'x'.center(2000000000) }}", r"str\.center\(\) would hold"),
    "expandtabs": ("{{ ('\t' * 1000).expandtabs(2000000) }}", r"str\.expandtabs\(\) would hold"),
    "percent": ("{{ '%02000000000d' % 1 }}", r"str % int would hold"),
    "percent_star": ("{{ '%*d' % (2000000000, 1) }}", r"str % tuple would hold"),
    "format": ("{{ '{:>2000000000}'.format(1) }}", r"str\.format\(\) would hold"),
    "format_nested_width": ("{{ '{:>{}}'.format(1, 2000000000) }}", r"str\.format\(\) would hold"),
    "format_precision": ("{{ '{:.2000000000f}'.format(1.5) }}", r"str\.format\(\) would hold"),
    "format_map": ("{{ '{x:>2000000000}'.format_map({'x': 1}) }}", r"str\.format_map\(\) would hold"),
    "markup_center": ("{{ ('x'|safe).center(2000000000) }}", r"Markup\.center\(\) would hold"),
    "bytes_center": ("{{ 'x'.encode().center(2000000000) }}", r"bytes\.center\(\) would hold"),
    "to_bytes": ("{{ (1).to_bytes(2000000000, 'big') }}", r"int\.to_bytes\(\) would hold"),
    # counts multiplying a string
    "replace": ("{{ ('x' * 3000000).replace('x', 'x' * 700) }}", r"str\.replace\(\) would hold"),
    "translate": ("{{ ('a' * 3000000).translate({97: 'b' * 1000}) }}", r"str\.translate\(\) would hold"),
    "join_method": (A + "{{ a.join(['', '', '', '']) }}", r"str\.join\(\) would hold"),
    "split": ("{{ ('ab ' * 1333333).split()|length }}", r"str\.split\(\) would hold"),
    "concat": (A + "{{ a ~ a }}", r"~ would hold 7999998 characters"),
    "chain": ("{{ 'x'.ljust(1900000000) ~ 'y'.center(1900000000) ~ 'z'.zfill(1900000000) }}", r"would hold"),
    "doubling_list": ("{% set a = [1, 1] %}" + "{% set a = [a, a] %}" * 40 + "{{ a == a }}",
                      r"a list, tuple or dict display would hold"),
    # filters
    "batch_fill": ("{{ [1]|batch(2000000000, 'x')|list|length }}", r"the batch filter would hold"),
    "slice": ("{{ [1]|slice(2000000000)|list|length }}", r"the slice filter would hold"),
    "tojson_indent": ("{{ range(1000)|list|tojson(indent=3000000) }}", r"the tojson filter would hold"),
    "wordwrap": ("{{ ('x' * 100000)|wordwrap(1, true, 'y' * 3000) }}", r"the wordwrap filter would hold"),
    "indent": ("{{ ('\n' * 100000)|indent(100) }}", r"the indent filter would hold"),
    # captured output: macros, {% set %} blocks, filter blocks
    "macro": (A + "{% macro f() %}{% for i in range(1000) %}{{ a }}{% endfor %}{% endmacro %}{% set t = f() %}",
              r"captured output would hold"),
    "set_block": (A + "{% set t %}{% for i in range(1000) %}{{ a }}{% endfor %}{% endset %}",
                  r"captured output would hold"),
    "filter_block": (A + "{% filter upper %}{% for i in range(1000) %}{{ a }}{% endfor %}{% endfilter %}",
                     r"captured output would hold"),
    # many values of a bounded size
    "many_centered": ("{{ range(1000)|map('string')|map('center', 3000000)|list|length }}",
                      r"the render built more than 16000000 characters or items in all"),
    "recursion_frames": ("{% macro f(s) %}{{ f(s ~ 'x') }}{% endmacro %}{{ f('x' * 3999990) }}",
                         r"the render built more than 16000000"),
    # time
    "nested_for_over_a_string": ("{% set s = 'x' * 3000 %}{% for a in s %}{% for b in s %}{% for c in s %}"
                                 "{% endfor %}{% endfor %}{% endfor %}", r"took more than 1000000 steps"),
    "recursive_loop": ("{% for x in [1] recursive %}{{ loop([1, 1]) }}{% endfor %}",
                       r"took more than 1000000 steps|recursed too deeply"),
    "lipsum": ("{{ lipsum(n=2000000) }}", r"lipsum\(n=2000000, max=100\) would build up to"),
    "urlize": ("{{ ('a ' * 1999999)|urlize }}", r"took more than 1000000 steps"),
    "dunder_method": ("{{ 'x'.removeprefix('y') ~ 'x'.isascii() ~ (2).bit_length() }}{{ 'x'.__len__() }}",
                      r"sandbox blocked"),
    "list_of_a_range": ("{{ range(1000000)|list|length }}", r"the list filter would hold 8000001 characters"),
    "replace_filter_non_string": ("{{ [('x' * 100000)]|replace('x', 'y' * 1000) }}", r"the replace filter would hold"),
}


def _render(template: str) -> str:
    return ChatTemplate(template, {"bos_token": "<s>"}, origin="probe.jinja").render([{"role": "user", "content": "Hi"}])


@pytest.fixture
def no_deadline(monkeypatch):
    """The step and size bounds alone, so which one stops a payload does not depend on how fast (or
    how loaded) the machine is; the deadline has its own test."""
    monkeypatch.setattr(ct, "MAX_RENDER_SECONDS", 3600.0)


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_every_payload_is_one_line_quickly_and_small(name, no_deadline):
    template, message = PAYLOADS[name]
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ConfigError, match=message) as error:
            _render(template)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = str(error.value)
    assert text.startswith("probe.jinja: ") and "\n" not in text, text
    assert peak < 100 * 2**20, f"{name}: {peak / 2**20:.0f} MB traced"
    # a bound, not a measurement (before, several never ended); benchmarks/template_bounds.py times them
    assert seconds < 120, f"{name}: {seconds:.1f} s (under tracemalloc)"


def test_a_render_that_outlasts_the_deadline_stops_naming_it(monkeypatch):
    """The clock is the last bound: a render under the step bound that still runs too long."""
    monkeypatch.setattr(ct, "MAX_RENDER_SECONDS", 0.2)
    monkeypatch.setattr(ct, "MAX_RENDER_STEPS", 10**12)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^probe\.jinja: the render ran longer than 0\.2 s; the chat template is refused"):
        _render(PAYLOADS["nested_for_over_a_string"][0])  # 2.7e10 iterations
    assert time.perf_counter() - start < 60  # a bound, not a measurement: without the clock, hours


def test_what_templates_do_is_unchanged():
    """The constructs released templates use render as Jinja's own sandbox renders them: loops
    (loop.length, last, recursive, else), namespace, macros with caller, filter blocks, set blocks,
    ~, %, format, lists and dicts, map/select/join/tojson, slicing, string methods."""
    source = (
        "{% set ns = namespace(n=0, text='') %}"
        "{% macro box(x) %}[{{ x }}|{{ caller() if caller else '' }}]{% endmacro %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% set ns.text = ns.text ~ m['role'][:1] %}"
        "{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }} {{ m.content.strip().upper() }}"
        "{% call box(m.role) %}{{ m.get('content', '')|length }}{% endcall %}{% else %}none{% endfor %}"
        "{% set block %}{% for k, v in {'a': 1, 'b': [2, 3]}|dictsort %}{{ k }}={{ v|tojson }};{% endfor %}{% endset %}"
        "{{ block }}{% filter upper %}shout {{ ns.text }}{% endfilter %}"
        "{{ '%s has %d' % ('x', ns.n) }} {{ '{} {:>4}'.format('y', 7) }} {{ 'a,b,c'.split(',')|join('+') }}"
        "{{ messages|map(attribute='role')|select('ne', 'user')|list }} {{ [1, 2, 3][::-1] }} "
        "{% for t in [{'n': 'a', 'c': [{'n': 'b', 'c': []}]}] recursive %}{{ t.n }}({{ loop(t.c) }}){% endfor %}"
        "{{ range(3)|sum }} {{ 'ab'.replace('a', 'A') ~ 'x'.center(5) ~ 'y'.zfill(3) }} {{ ['q'] * 2 }}"
        "{% if add_generation_prompt %}<gen>{% endif %}"
    )
    messages = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    expected = plain.from_string(source).render(messages=messages, add_generation_prompt=True)
    assert ChatTemplate(source, {}).render(messages, add_generation_prompt=True) == expected


def test_every_method_filter_and_operator_is_accounted_for():
    """A string or number method the size tables do not know (a newer Python's) is refused rather
    than run unbounded; every filter is either sized or known to stay within its input; every
    binary operator is intercepted."""
    methods = {m for kind in (str, bytes, int, float, bool, Markup) for m in dir(kind)
               if not m.startswith("_") and callable(getattr(kind, m))}
    assert methods <= set(ct._METHOD_SIZES) | ct._METHODS_WITHIN_INPUT, methods - set(ct._METHOD_SIZES) - ct._METHODS_WITHIN_INPUT
    filters = set(ImmutableSandboxedEnvironment().filters)
    assert filters <= set(ct._FILTER_SIZES) | ct._FILTERS_WITHIN_INPUT, filters - set(ct._FILTER_SIZES) - ct._FILTERS_WITHIN_INPUT
    assert ct.BoundedSandbox.intercepted_binops == {"+", "-", "*", "/", "//", "%", "**"}
    known = ct._METHODS_WITHIN_INPUT
    try:
        ct._METHODS_WITHIN_INPUT = known - {"removeprefix"}  # as if a newer Python had added it
        with pytest.raises(ConfigError, match="str.removeprefix is not a method the template sandbox knows"):
            _render("{{ 'xy'.removeprefix('x') }}")
    finally:
        ct._METHODS_WITHIN_INPUT = known
    assert _render("{{ 'xy'.removeprefix('x') }}") == "y"
    env = compile_template("x").environment
    assert env.globals["lipsum"] is ct._bounded_lipsum and env.globals["range"] is ct._bounded_range


def test_a_released_template_renders_a_long_conversation_within_the_bounds():
    """Two thousand messages of a real-sized conversation: far below every bound."""
    from dsl_lit.posttrain.chat.tokenizer import DEEPSEEK_TEMPLATE

    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(2000)]
    text = ChatTemplate(DEEPSEEK_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}).render(messages)
    assert text.count("message 1999 ") == 20


def test_doc_to_text_payloads_in_an_eval_set_are_one_line(tmp_path):
    """Before: the pipeline hung building the decontamination index."""
    (tmp_path / "rows.jsonl").write_text(json.dumps({"q": "hello"}) + "\n")
    for name in ("ljust", "nested_for_over_a_string", "lipsum", "percent"):
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "rows.jsonl"}},
                "doc_to_text": PAYLOADS[name][0]}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(task))  # JSON is YAML
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=rf"{name}\.yaml: the template .* failed: TemplateLimitError") as error:
            ngram_index(DecontaminateConfig(eval_sets=[str(tmp_path / f"{name}.yaml")]).validate())
        assert "\n" not in str(error.value) and time.perf_counter() - start < 60  # a bound: before, a hang
    with pytest.raises(ConfigError, match="would hold"):
        render_bounded("{{ q.zfill(2000000000) }}", "inline", q="x")


def test_the_pipeline_refuses_such_an_eval_set_in_one_line(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"q": "hello"}) + "\n")
    (tmp_path / "bomb.yaml").write_text(json.dumps({"task": "bomb", "dataset_path": "json",
                                                    "dataset_kwargs": {"data_files": {"test": "rows.jsonl"}},
                                                    "doc_to_text": PAYLOADS["nested_for_over_a_string"][0]}))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "d.jsonl").write_text(json.dumps({"id": "a", "text": "an ordinary document"}) + "\n")
    result = run_python([sys.executable, "-m", "data_pipeline", f"input.path={tmp_path / 'corpus'}",
                         f"output_dir={tmp_path / 'out'}", "stages=[decontaminate]",
                         f"decontaminate.eval_sets=[{tmp_path / 'bomb.yaml'}]"],
                        cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "bomb.yaml: the template" in output and re.search(STEPS_OR_CLOCK, output)
    assert "Traceback" not in output


@pytest.mark.slow
def test_sft_refuses_such_a_template_in_one_line(tmp_path):
    """Before: ``recipes/sft.py`` hung rendering the task's conversations."""
    from data_pipeline.tokenizer.training import tokenizer_spec, train_tokenizer

    texts = [f"{w} the quick brown fox {i}" for i, w in enumerate(["alpha", "beta", "gamma"] * 200)]
    directory = train_tokenizer(texts, 300, tmp_path / "tok", spec=tokenizer_spec("deepseek_v3"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": PAYLOADS["nested_for_over_a_string"][0]}))
    start = time.perf_counter()
    result = run_python([sys.executable, str(ROOT / "recipes" / "sft.py"), f"hydra.run.dir={tmp_path / 'run'}",
                         f"tokenizer_dir={directory}", "+model.vocab_size=129280", "logger=csv",
                         f"data.cache_dir={tmp_path / 'never_built'}"],
                        cwd=ROOT, timeout=300, env={**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(rf"tokenizer_config\.json: the render (?:{STEPS_OR_CLOCK})", result.stderr)
    assert "Traceback" not in result.stderr
    assert time.perf_counter() - start < 120


@pytest.mark.parametrize("source, message", [
    ("{{ 1/0 }}", "the chat template failed: ZeroDivisionError"),
    ("{% include 'other.jinja' %}", "the chat template includes or imports another file"),
    ("{{ (1).bit_length(2) }}", "the chat template failed: TypeError"),
])
def test_a_template_that_fails_in_its_own_code_is_one_line(source, message):
    """Before: ZeroDivisionError / TypeError tracebacks, and an include read as the conversation's fault."""
    template = ChatTemplate(source, {"eos_token": "</s>"}, origin="tok/tokenizer_config.json")
    with pytest.raises(ConfigError, match=rf"^tok/tokenizer_config\.json: {message}"):
        template.render([{"role": "user", "content": "hi"}])


def test_special_tokens_given_as_lists_are_one_line():
    with pytest.raises(ConfigError, match=r"special token eos_token=\['</s>'\] must be one string .*not a list$"):
        ChatTemplate("{{ eos_token }}", {"eos_token": ["</s>"]}, origin="tok")
    assert ChatTemplate("{{ eos_token }}", {"eos_token": {"content": "</s>"}}).render([]) == "</s>"
