"""A recipe's ``--help``: the config groups it composes with their options, then every key with its
value and what it means, in the terminal.

Every recipe answers ``--help`` (``-h``) in its first lines, before it imports torch (seconds)::

    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:  # groups and keys explained, before torch's import
        from dsl_lit.config.help import print_recipe_help

        print_recipe_help(__file__)  # exits 0

The page is built from what the recipe really composes: its primary config (the ``config_name`` of
its ``@hydra.main``, else its file name) composed by Hydra with the command line's overrides, so
``python recipes/sft.py model=deepseek_llm_7b --help`` shows that model's values. A key's meaning
is the attribute docstring (or trailing comment) of the dataclass field that validates it
(:data:`SCHEMAS`), then the comments on that key in the YAML files composed; a group's is its
dataclass's docstring. Sources are read with ``ast``, never imported. Bare words filter the keys:
``--help optim data`` shows only the ``optim`` and ``data`` sections.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import shutil
import sys
import textwrap
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

SRC = Path(__file__).resolve().parents[1]
"""``src/dsl_lit``: where the dataclasses named in :data:`SCHEMAS` live."""

TRAINING = (("", "config/train.py:TrainConfig"), ("", "config/posttrain.py:PostTrainConfig"))
SCHEMAS: dict[str, tuple[tuple[str, str], ...]] = {
    "evaluate": (("", "config/evaluate.py:EvaluateConfig"),),
    "passkey": (("", "config/passkey.py:PasskeyConfig"),),
    "reproduce": (("reproduce", "config/reproduce.py:ReproduceConfig"),),
    "plan": (("plan", "scaling/planner/config.py:PlanOptions"), ("cluster", "scaling/planner/cluster.py:ClusterConfig"),
             *TRAINING),
    "scaling_laws": (("sweep", "scaling/sweep.py:SweepConfig"), *TRAINING),
}
"""Primary config name -> (key prefix, ``file:Class`` under ``src/dsl_lit``) pairs whose fields
document the keys under that prefix, the first that knows a key wins. Any other config (the
training and post-training recipes, a copied recipe's own) is documented by :data:`TRAINING`."""

_ROLE = re.compile(r":(?:attr|class|meth|mod|func|data):`~?([^`]+)`")


@dataclass
class FieldDoc:
    annotation: str
    doc: str
    default: str | None = None
    """The field's default as YAML flow text, when it is a literal."""


@dataclass
class ClassDoc:
    doc: str
    fields: dict[str, FieldDoc] = field(default_factory=dict)
    file: Path | None = None


def _plain(text: str) -> str:
    """Docstring markup -> terminal text: ``x`` and :attr:`x` become `x`; each paragraph (and each
    item of a ``-`` list) one line."""
    text = _ROLE.sub(r"`\1`", inspect.cleandoc(text)).replace("``", "`")
    text = re.sub(r"\n\s*(?=[-*] )", "\n\n", text)
    return "\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip())


def _inline_comments(source: str) -> dict[int, str]:
    """Line number -> the comment that ends a line of code."""
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.start[0] in code_lines:
            comments[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    return comments


def read_classes(path: Path) -> dict[str, ClassDoc]:
    """Every class of a source file: its docstring and its annotated fields' docstrings (the string
    right after the field) or trailing comments."""
    source = path.read_text(encoding="utf-8")
    comments = _inline_comments(source)
    classes: dict[str, ClassDoc] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        found = ClassDoc(doc=_plain(ast.get_docstring(node) or ""), file=path)
        for i, stmt in enumerate(node.body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            after = node.body[i + 1] if i + 1 < len(node.body) else None
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                doc = after.value.value
            else:
                doc = comments.get(stmt.end_lineno or stmt.lineno, "")
            try:
                value = ast.literal_eval(stmt.value) if stmt.value is not None else None
                default = (ast.get_source_segment(source, stmt.value) if isinstance(value, float) else _flow(value)
                           ) if stmt.value is not None else None
            except ValueError:  # field(default_factory=...), an expression
                default = None
            found.fields[stmt.target.id] = FieldDoc(ast.unparse(stmt.annotation), _plain(doc), default)
        classes[node.name] = found
    return classes


class Schemas:
    """The dataclasses that document a primary config's keys (:data:`SCHEMAS`)."""

    def __init__(self, config_name: str) -> None:
        self.roots = [(prefix, spec.split(":")) for prefix, spec in SCHEMAS.get(config_name, TRAINING)]
        files = {SRC / file for _, (file, _) in self.roots} | set((SRC / "config").glob("*.py"))
        self.classes: dict[str, ClassDoc] = {}
        for path in sorted(files):
            for name, doc in read_classes(path).items():
                self.classes.setdefault(name, doc)
        self._local = {(SRC / file, name): doc for file in {f for _, (f, _) in self.roots}
                       for name, doc in read_classes(SRC / file).items()}

    def _class_of(self, annotation: str, near: ClassDoc) -> ClassDoc | None:
        """The documented class an annotation names (``X``, ``X | None``), preferring ``near``'s file."""
        for name in re.findall(r"[A-Za-z_]\w*", annotation):
            if near.file is not None and (near.file, name) in self._local:
                return self._local[(near.file, name)]
            if name in self.classes and name not in ("None", "Any"):
                return self.classes[name]
        return None

    def lookup(self, key: str) -> tuple[ClassDoc | None, FieldDoc | None]:
        """(the class of the section ``key`` names, if any; the field ``key`` names, if any)."""
        for prefix, (_, class_name) in self.roots:
            if prefix and not (key == prefix or key.startswith(prefix + ".")):
                continue
            cls = self.classes.get(class_name)
            rest = key[len(prefix):].lstrip(".") if prefix else key
            found: FieldDoc | None = None
            for part in rest.split(".") if rest else []:
                if cls is None or part not in cls.fields:
                    cls, found = None, None
                    break
                found = cls.fields[part]
                cls = self._class_of(found.annotation, cls)
            if cls is not None or found is not None:
                return cls, found
        return None, None


# -- the YAML side: which files are composed, and their comments ------------------------------------

_KEY = re.compile(r"^(\s*)([A-Za-z_][\w.-]*)\s*:(?:\s+(.*))?$")


def _split_comment(rest: str) -> tuple[str, int]:
    """``value  # comment`` -> (comment, where its ``#`` is; -1: none), a ``#`` inside quotes or
    ``${...}`` not counted."""
    quote, depth = "", 0
    for i, char in enumerate(rest):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "#" and depth <= 0 and (i == 0 or rest[i - 1].isspace()):
            return rest[i + 1:].strip(), i
    return "", -1


def yaml_comments(path: Path, package: str) -> tuple[str, str, dict[str, str]]:
    """(the file's package, its header comment, dotted key -> its comments): the comment ending the
    key's line (and the comment lines under it in the same column), else the comment lines right
    above it. ``package`` prefixes the keys unless the file declares its own (``# @package _global_``)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header: list[str] = []
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    above: list[str] = []
    in_header, last_key, last_column = True, "", -1
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("# @package"):
            declared = stripped.split()[-1]
            package = "" if declared == "_global_" else declared
            continue
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if last_key and line.index("#") == last_column:  # the comment of the key above, continued
                comments[last_key] += " " + text
            else:
                (header if in_header else above).append(text)
            continue
        last_key, last_column = "", -1
        in_header = False
        match = _KEY.match(line)
        if not stripped or not match:
            above = []
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        comment, column = _split_comment(match.group(3) or "")
        dotted = ".".join(([package] if package else []) + [k for _, k in stack])
        text = " ".join(above + ([comment] if comment else []))
        if text and stack[0][1] not in ("defaults", "hydra"):
            comments[dotted] = text
            if comment:
                last_key, last_column = dotted, match.start(3) + column
        above = []
    return package, " ".join(header), comments


def recipe_config(recipe: Path) -> tuple[Path, str, bool]:
    """(config dir, primary config name, whether Hydra runs it) of a recipe: its ``@hydra.main``'s,
    else ``conf/<file name>.yaml`` (a recipe that parses ``key=value`` itself, as ``export_hf.py``)."""
    conf, name, hydra_main = recipe.resolve().parents[1] / "conf", recipe.stem, False
    for node in ast.walk(ast.parse(recipe.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "hydra.main":
            kwargs = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
            name, hydra_main = kwargs.get("config_name") or name, True
            if kwargs.get("config_path"):
                conf = (recipe.resolve().parent / kwargs["config_path"]).resolve()
    return conf, name, hydra_main


def compose(conf: Path, name: str, overrides: list[str]) -> Any:
    """The recipe's config as Hydra composes it (interpolations left unresolved), with ``hydra.runtime.choices``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3", job_name=name):
        return hydra_compose(name, overrides=overrides, return_hydra_config=True)


# -- the page ----------------------------------------------------------------------------------------


def _flow(value: Any) -> str:
    """A value as one line of YAML flow style (what ``key=value`` on the command line takes)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return str(value)


@dataclass
class Key:
    key: str
    value: str | None
    docs: list[str]
    unset: bool = False
    """Not in the composed config: set it with ``+key=value``."""
    note: str = ""


@dataclass
class Section:
    name: str
    docs: list[str]
    keys: list[Key] = field(default_factory=list)


class HelpPage:
    """Everything the page says about one recipe's composed config."""

    def __init__(self, recipe: Path, overrides: list[str] | None = None) -> None:
        from omegaconf import OmegaConf

        self.recipe = recipe.resolve()
        self.conf, self.config_name, self.hydra_main = recipe_config(self.recipe)
        cfg = compose(self.conf, self.config_name, list(overrides or []))
        choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
        self.choices = {g: c for g, c in reversed(list(choices.items())) if not g.startswith("hydra/")}
        self.values = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}
        self.schemas = Schemas(self.config_name)
        self.files = [(self.conf / f"{self.config_name}.yaml", "")] + [
            (self.conf / group / f"{choice}.yaml", group.replace("/", "."))
            for group, choice in self.choices.items() if choice is not None
        ]
        self.headers: dict[str, str] = {}
        self.comments: dict[str, list[tuple[str, str, str]]] = {}
        """key -> (file, its package, comment) of each composed YAML file that comments the key."""
        for path, package in self.files:
            if not path.is_file():
                continue
            package, header, comments = yaml_comments(path, package)
            if package:
                self.headers[package] = header
            for key, text in comments.items():
                self.comments.setdefault(key, []).append((self._shown(path), package, text))

    def _shown(self, path: Path) -> str:
        root = self.conf.parent
        return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)

    def options(self, group: str) -> list[str]:
        return sorted(p.stem for p in (self.conf / group).glob("*.yaml"))

    def _docs(self, key: str, schema_doc: str) -> list[str]:
        """What ``key`` means (its field's docstring, else its group's YAML comment), then why other
        files (the primary config, an experiment) set it as they do, each naming its file."""
        docs = [schema_doc] if schema_doc else []
        group = next((g.replace("/", ".") for g in self.choices if (key + ".").startswith(g.replace("/", ".") + ".")), "")
        for source, package, text in self.comments.get(key, []):
            own = package == group  # the file that defines the key: its group's option, else the primary config
            if not docs:
                docs.append(text)
            elif not own and not any(text in d for d in docs):
                docs.append(f"{text} ({source})")
        return docs

    def _unset(self, section: str, cls: ClassDoc) -> dict[str, Any]:
        """Values of the fields a section's YAML leaves out: the model preset's (``model.name``)."""
        if section != "model" or not isinstance(self.values.get("model"), dict):
            return {}
        try:
            from dsl_lit.config.model import ModelConfig

            preset = ModelConfig.from_name(str(self.values["model"].get("name")))
        except Exception:  # an unknown preset: its fields are shown without values
            return {}
        return {name: getattr(preset, name) for name in cls.fields if hasattr(preset, name)}

    def _walk(self, prefix: str, values: Any, section: Section) -> None:
        cls, _ = self.schemas.lookup(prefix) if prefix else (None, None)
        for name, value in values.items():
            key = f"{prefix}.{name}" if prefix else name
            sub, found = self.schemas.lookup(key)
            nested = isinstance(value, dict) and value and (sub is not None or found is None)
            if nested:
                docs = [d for d in (sub.doc if sub else "", *(t for _, _, t in self.comments.get(key, []))) if d]
                if docs:  # a nested group (data.batch_ramp): what it is, before its keys
                    section.keys.append(Key(key, None, docs))
                self._walk(key, value, section)
            else:
                section.keys.append(Key(key, _flow(value), self._docs(key, found.doc if found else "")))
        if cls is not None and prefix:  # fields the YAML leaves to the dataclass (or the model preset)
            unset = self._unset(prefix, cls)
            for name, fdoc in cls.fields.items():
                if name.startswith("_") or name in values:
                    continue
                key = f"{prefix}.{name}"
                value, origin = (_flow(unset[name]), "the preset's") if name in unset else (fdoc.default, "default")
                note = f"{fdoc.annotation}; {origin}" if value is not None else fdoc.annotation
                section.keys.append(Key(key, value, self._docs(key, fdoc.doc), unset=True, note=note))

    def sections(self, only: list[str] | None = None) -> list[Section]:
        top = Section(f"top-level keys ({self._shown(self.conf / (self.config_name + '.yaml'))})", [])
        sections: list[Section] = []
        for name, value in self.values.items():
            if only and not any(name.startswith(o) for o in only):
                continue
            cls, found = self.schemas.lookup(name)
            if isinstance(value, dict) and (cls is not None or found is None):
                header = self.headers.get(name, "")
                docs = [d for d in (cls.doc if cls else "", header) if d] + [t for _, _, t in self.comments.get(name, [])]
                section = Section(name, docs)
                self._walk(name, value, section)
                sections.append(section)
            else:
                top.keys.append(Key(name, _flow(value), self._docs(name, found.doc if found else "")))
        return sections + ([top] if top.keys else [])

    def text(self, only: list[str] | None = None, width: int = 100) -> str:
        out: list[str] = []
        doc = ast.get_docstring(ast.parse(self.recipe.read_text(encoding="utf-8"))) or ""
        doc = _ROLE.sub(r"`\1`", doc).replace("``", "`")
        script = f"python recipes/{self.recipe.name}" if self.recipe.parent.name == "recipes" else f"python {self.recipe}"
        out += [f"{script.removeprefix('python ')}: {doc}".rstrip(), ""]
        usage = f"Usage: {script}{' [group=option ...]' if self.choices else ''} [key=value ...]"
        if self.hydra_main:
            usage += " [+key=value ...]; -m sweeps comma-separated values (a Hydra multirun)"
        out += [usage, f"Config: {self._shown(self.conf / (self.config_name + '.yaml'))}"
                + ("; `--cfg job` prints it composed" if self.hydra_main else "")
                + "; `--help <section> ...` shows only those sections", ""]
        wrap = textwrap.TextWrapper(width=width, initial_indent="      ", subsequent_indent="      ")
        if self.choices:
            out.append("== Config groups: pick an option with group=option (default first) ==")
            for group, choice in self.choices.items():
                others = [o for o in self.options(group) if o != choice]
                line = f"  {group}: {choice if choice is not None else '(none)'}"
                out += textwrap.wrap(line + ("; also " + ", ".join(others) if others else ""), width=width,
                                     subsequent_indent="      ")
            out.append("")
        out.append("== Keys: change one with key=value" + ("; + marks a key the YAML leaves out (set it with "
                   "+key=value) ==" if self.hydra_main else " =="))
        for section in self.sections(only):
            out.append("")
            out.append(f"{section.name}:")
            for doc in section.docs:
                out += textwrap.wrap(doc, width=width, initial_indent="  ", subsequent_indent="  ")
            for key in section.keys:
                value = f"={key.value}" if key.value is not None else ("" if key.unset else ".*")
                line = f"  {'+' if key.unset else ''}{key.key}{value}"
                out.append(line + (f"  ({key.note})" if key.note else ""))
                for doc in key.docs:
                    for paragraph in doc.split("\n"):
                        out += wrap.wrap(paragraph)
        return "\n".join(out) + "\n"


def print_recipe_help(recipe: str | Path, argv: list[str] | None = None) -> NoReturn:
    """Print ``recipe``'s help page for ``argv`` (default: the command line) and exit: 0, or 2 when
    the overrides do not compose."""
    args = sys.argv[1:] if argv is None else argv
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    only = [a for a in args if "=" not in a and not a.startswith("-")]
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(overrides)  # a sweep's a,b values: the page shows the default
        overrides = [o.input_line for o in parsed if not o.is_sweep_override() and o.input_line]
        page = HelpPage(Path(recipe), overrides)
    except Exception as error:  # an override Hydra cannot compose: say so in one line
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    width = max(80, min(shutil.get_terminal_size((100, 24)).columns, 120))
    sys.stdout.write(page.text(only or None, width=width))
    raise SystemExit(0)
