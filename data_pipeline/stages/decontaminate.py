"""Stage ``decontaminate``: remove training documents that share a word n-gram with an evaluation set.

Why: a benchmark whose questions sit in the training data measures memorisation. DeepSeekMath and
DeepSeek-Coder filter their corpora by 10- to 13-gram overlap with the benchmarks they report;
this stage does the same at the document level (GPT-3's and lm-eval's convention too): a document
containing any evaluation n-gram is removed, and set aside with its reason like every other removal
(``removed/``, ``contamination:<eval set>``), so it can be inspected and counted.

What an evaluation set yields (``decontaminate.eval_sets``: files or directories):

* an lm-eval task YAML: the text the model is shown (``doc_to_text`` rendered over each record of
  its ``data_files``) and the gold answer (``doc_to_target``, or ``doc_to_choice[doc_to_target]``
  for multiple choice): the distractors are not the benchmark's answers and stay;
* a ``.jsonl`` or ``.parquet`` file: every string (and list of strings) in every record.

Texts are compared as words (letters and digits; punctuation and spacing ignored) of their canonical
form (:func:`canonical`), the same for the evaluation texts and the training documents, so that a
copy disguised by Unicode is caught whether or not a ``normalize`` stage ran first (the data
module's own build has none): compatibility forms (fullwidth, ligatures, mathematical letters)
decomposed (NFKD), combining marks and default-ignorable code points (soft hyphens, zero-width
spaces and joiners, the combining grapheme joiner, variation selectors, BOMs, bidi controls) dropped,
Cyrillic and Greek letters that look like Latin ones mapped to them, and case folded. A
text of ``ngram`` words or more contributes its ``ngram``-word windows; a shorter one of at least
``min_words`` words contributes itself whole (a short benchmark sentence is still a leak); a shorter
one of at least ``WHOLE_DOCUMENT_WORDS`` words only removes a document that is that text and nothing
else (a 4-word dictionary entry copied as a document is the benchmark item; the same 4 words inside
a chapter are not evidence: ``"5 + 6"`` is no contamination).
"""

from __future__ import annotations

import ast
import dataclasses as dc
import functools
import json
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from data_contract.errors import ConfigError
from data_pipeline.context import Context
from data_pipeline.document_step import Verdicts, write_split
from data_pipeline.io.shards import read_documents, shard_file
from data_pipeline.stage import Stage, Step

BUNDLED_TASKS = Path(__file__).resolve().parents[2] / "data" / "eval_tasks"
"""The project's own lm-eval tasks: the default evaluation sets."""
_WORD = re.compile(r"[^\W_]+")
WHOLE_DOCUMENT_WORDS = 3
WHOLE = 0
"""The index key of the texts shorter than ``min_words``: matched only by a whole document."""
TEXT_FORM = "nfkd-nomarks-noignorables-confusables-casefold/1; short texts as whole documents/3"
"""What :func:`canonical` does and which texts are matched how (in the stage's settings: changing it
reruns the stage; ``dsl_lit.data.cache.DECONTAMINATION_RULES`` repeats it, so that a data module's
build made under other rules is rebuilt: a test ties the two)."""

# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt): drawn as nothing.
_IGNORABLE_BMP = ("\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e"
                  "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8")
_IGNORABLE_ASTRAL = ((0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF))
# Letters drawn like Latin ones (Latin targets of Cyrillic and Greek letters in Unicode's
# confusables.txt, and the lower-case forms of capitals that look Latin, since case is folded after).
_CONFUSABLES = str.maketrans({
    # Cyrillic capitals and small letters
    "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H", "О": "O", "Р": "P", "С": "C", "Т": "T",
    "У": "Y", "Х": "X", "Ѕ": "S", "І": "I", "Ј": "J", "Ԛ": "Q", "Ԝ": "W", "Ү": "Y", "Һ": "H", "Ӏ": "I",
    "а": "a", "в": "b", "е": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c", "т": "t",
    "у": "y", "х": "x", "ѕ": "s", "і": "i", "ј": "j", "ԛ": "q", "ԝ": "w", "ү": "y", "һ": "h", "ӏ": "l",
    "ԁ": "d", "ɡ": "g", "ѵ": "v", "ѡ": "w",
    # Greek capitals and small letters
    "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N", "Ο": "O",
    "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X", "ϲ": "c", "Ϲ": "C", "ϳ": "j",
    "α": "a", "β": "b", "ε": "e", "ζ": "z", "η": "h", "ι": "i", "κ": "k", "μ": "m", "ν": "v", "ο": "o",
    "ρ": "p", "τ": "t", "υ": "u", "χ": "x", "γ": "y",
    # Latin letters drawn like others
    "ı": "i", "ȷ": "j", "ɑ": "a", "ʏ": "y", "ɩ": "i",
})
_LOOKALIKE = re.compile("[" + "".join(map(chr, _CONFUSABLES)) + "]")


@functools.cache
def _dropped() -> tuple[re.Pattern[str], dict[int, None]]:
    """Default-ignorable code points and combining marks (Mn, Me; all below U+20000): those of the
    Basic Multilingual Plane as a pattern (a bitmap to the regex engine), the others as a
    ``str.translate`` table (a pattern holding them would be matched range by range)."""
    marks = [c for c in range(0x300, 0x20000) if unicodedata.category(chr(c)) in ("Mn", "Me")]
    bmp = re.compile("[" + _IGNORABLE_BMP + "".join(re.escape(chr(c)) for c in marks if c < 0x10000) + "]+")
    astral = [c for c in marks if c >= 0x10000] + [c for lo, hi in _IGNORABLE_ASTRAL for c in range(lo, hi + 1)]
    return bmp, dict.fromkeys(astral)


def canonical(text: str) -> str:
    """The form texts are compared in: ``"Ｔhe c\u00adat"``, ``"Тhе cat"`` (Cyrillic) and
    ``"THE CAT"`` are all ``"the cat"``."""
    if text.isascii():
        return text.lower()
    bmp, astral = _dropped()
    text = bmp.sub("", unicodedata.normalize("NFKD", text))
    if text and max(text) > "\uffff":
        text = text.translate(astral)
    if _LOOKALIKE.search(text):
        text = text.translate(_CONFUSABLES)
    return text.casefold()


def words(text: str) -> list[str]:
    """The words ``text`` is compared by: of its canonical form (:func:`canonical`)."""
    return _WORD.findall(canonical(text))


@dataclass
class DecontaminateConfig:
    eval_sets: list[str] | None = None
    """Files or directories of evaluation sets (lm-eval task YAMLs, .jsonl, .parquet); null: the
    bundled tasks in data/eval_tasks (their YAMLs)."""
    ngram: int = 13
    min_words: int = 8

    def validate(self) -> DecontaminateConfig:
        if not 8 <= self.ngram <= 50:
            raise ConfigError(f"decontaminate.ngram={self.ngram} must lie in [8, 50] (DeepSeek used 10-13)")
        if not 1 <= self.min_words <= self.ngram:
            raise ConfigError(f"decontaminate.min_words={self.min_words} must lie in [1, decontaminate.ngram]")
        for path in self.paths():
            if not path.exists():
                raise ConfigError(f"decontaminate.eval_sets: {path} does not exist")
        return self

    def paths(self) -> list[Path]:
        return [Path(p) for p in self.eval_sets] if self.eval_sets is not None else [BUNDLED_TASKS]


# -- what an evaluation set shows ----------------------------------------------------------------------


def _records(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".parquet":
        yield from pq.read_table(path).to_pylist()
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if isinstance(record, dict):
                    yield record


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _field(template: Any, record: dict[str, Any], origin: str) -> Any:
    """An lm-eval ``doc_to_*`` value over one record: a field name, or a ``{{field}}`` template
    (rendered in the bounded sandbox of ``data_contract.chat_template``; a rendered list such as
    ``"{{choices}}"`` is read back as one). A Python function (``!function``) gives None."""
    if not isinstance(template, str):
        return None if isinstance(template, _Function) else template
    if template in record:
        return record[template]
    from data_contract.chat_template import render_bounded

    text = render_bounded(template, origin, **record)
    if text.startswith("[") and text.endswith("]"):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    return text


class _Function(str):
    """An lm-eval ``!function module.name`` value: code we do not run (its texts are not indexed)."""


class _TaskLoader(yaml.SafeLoader):
    """YAML with lm-eval's ``!function`` tag read as a :class:`_Function` (never imported or run)."""


_TaskLoader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))


def _task(yaml_path: Path, depth: int = 0) -> dict[str, Any]:
    """A task YAML with its ``include:`` (a YAML beside it) merged under it, as lm-eval does."""
    task = yaml.load(yaml_path.read_text(encoding="utf-8"), Loader=_TaskLoader)  # noqa: S506 (a SafeLoader)
    if not isinstance(task, dict):
        return {}
    include = task.pop("include", None)
    if isinstance(include, str) and depth < 8:
        base = (yaml_path.parent / include).resolve()
        if base.is_file():
            return {**_task(base, depth + 1), **task}
    return task


def task_texts(yaml_path: Path) -> Iterator[str]:
    """What an lm-eval task shows the model and its gold answers, record by record."""
    task = _task(yaml_path)
    if "task" not in task:
        return
    files = ((task.get("dataset_kwargs") or {}).get("data_files")) or {}
    names = files.values() if isinstance(files, dict) else [files]
    origin = str(yaml_path)
    for name in [n for entry in names for n in ([entry] if isinstance(entry, str) else entry)]:
        path = (yaml_path.parent / name).resolve()
        if not path.is_file():
            raise ConfigError(f"decontaminate.eval_sets: {yaml_path} names data file {name}, which does not exist")
        for record in _records(path):
            if task.get("doc_to_text") is not None:
                yield from _strings(_field(task["doc_to_text"], record, origin))
            target = _field(task.get("doc_to_target"), record, origin) if task.get("doc_to_target") is not None else None
            choices = _field(task.get("doc_to_choice"), record, origin) if task.get("doc_to_choice") is not None else None
            if isinstance(choices, list) and isinstance(target, (int, str)) and str(target).isdigit():
                index = int(target)
                target = choices[index] if 0 <= index < len(choices) else None
            yield from _strings(target)


def eval_texts(path: Path) -> Iterator[tuple[str, str]]:
    """(set name, text) of every evaluation text under ``path``."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    has_tasks = any(f.suffix in (".yaml", ".yml") for f in files)
    for file in files:
        if file.suffix in (".yaml", ".yml"):
            for text in task_texts(file):
                yield file.stem, text
        elif file.suffix in (".jsonl", ".parquet") and not (path.is_dir() and has_tasks):
            for record in _records(file):  # a directory of tasks: their YAMLs say what is shown
                for value in record.values():
                    for text in _strings(value):
                        yield file.stem, text


def ngram_index(cfg: DecontaminateConfig) -> dict[int, dict[tuple[str, ...], str]]:
    """Word-tuple length -> {n-gram: the evaluation set it came from}; :data:`WHOLE` -> the short
    texts matched only by a whole document."""
    index: dict[int, dict[tuple[str, ...], str]] = {}
    for path in cfg.paths():
        for name, text in eval_texts(path):
            tokens = words(text)
            if len(tokens) >= cfg.ngram:
                grams = index.setdefault(cfg.ngram, {})
                for i in range(len(tokens) - cfg.ngram + 1):
                    grams.setdefault(tuple(tokens[i : i + cfg.ngram]), name)
            elif len(tokens) >= cfg.min_words:
                index.setdefault(len(tokens), {}).setdefault(tuple(tokens), name)
            elif len(tokens) >= WHOLE_DOCUMENT_WORDS:
                index.setdefault(WHOLE, {}).setdefault(tuple(tokens), name)
    if not set(index) - {WHOLE}:
        raise ConfigError(f"decontaminate.eval_sets={[str(p) for p in cfg.paths()]} hold no text of "
                          f"{cfg.min_words} words or more: nothing to decontaminate against")
    return index


def contamination(text: str, index: dict[int, dict[tuple[str, ...], str]]) -> str | None:
    """The evaluation set ``text`` shares an n-gram with (None: clean)."""
    tokens = words(text)
    if WHOLE in index and (found := index[WHOLE].get(tuple(tokens))) is not None:
        return found
    for length, grams in index.items():
        if length == WHOLE:
            continue
        for i in range(len(tokens) - length + 1):
            found = grams.get(tuple(tokens[i : i + length]))
            if found is not None:
                return found
    return None


# -- the stage ------------------------------------------------------------------------------------------

_INDEXES: dict[str, dict[int, dict[tuple[str, ...], str]]] = {}


def run_unit(ctx: Context, unit: int) -> dict[str, Any]:
    cfg: DecontaminateConfig = ctx.config
    key = json.dumps(dc.asdict(cfg), sort_keys=True)
    if key not in _INDEXES:  # once per process: every unit of the step shares it
        _INDEXES[key] = ngram_index(cfg)
    index = _INDEXES[key]
    docs = read_documents(ctx.docs_dir / shard_file(unit))
    reasons = []
    for text in docs["text"]:
        found = contamination(text or "", index)
        reasons.append(f"contamination:{found}" if found else None)
    return write_split(ctx, unit, docs, Verdicts(reasons))


class Decontaminate(Stage):
    name = "decontaminate"
    Config = DecontaminateConfig
    comes_after = ("normalize",)

    def settings(self) -> Any:
        """Its settings and the evaluation sets' content: editing a benchmark file reruns the stage."""
        from data_contract.corpus import file_listing, listing_digest

        files = [str(f.resolve()) for p in self.config.paths()
                 for f in (sorted(p.rglob("*")) if p.is_dir() else [p]) if f.is_file()]
        return {**dc.asdict(self.config), "text_form": TEXT_FORM,
                "eval_content": listing_digest(file_listing(Path("/"), files, 1 << 30))}

    def steps(self) -> list[Step]:
        return [self.step(run_unit, writes_documents=True)]
