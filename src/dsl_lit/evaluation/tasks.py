"""Task YAMLs that load from any working directory: local data paths resolve from the YAML's own
directory, not from wherever the command was started.

lm-eval hands ``dataset_kwargs`` to ``datasets.load_dataset`` as written, so a task with
``data_files: test.jsonl`` works only when started from the directory holding it. Before lm-eval
sees a task directory, :func:`resolve_task_dirs` mirrors it into a work directory: every YAML is
rewritten with its local paths (``dataset_kwargs.data_files``, ``dataset_kwargs.data_dir``, a
local ``dataset_path``, an ``include`` outside the directory) made absolute when they exist
relative to the YAML; every other file (``!function`` helpers, templates, data) is linked, so
helpers that read files beside them still find them. A path that exists nowhere is a
ConfigError naming the YAML, before any model is loaded. lm-eval's own tasks are left as they are.
"""

from __future__ import annotations

import difflib
import glob
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from data_contract.errors import ConfigError

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
"""``dataset_path`` values of the ``datasets`` builders that read local files (``data_files``)."""
YAML_SUFFIXES = (".yaml", ".yml")


class Tagged:
    """A YAML node with a tag this module does not interpret (lm-eval's ``!function``), kept as is."""

    def __init__(self, tag: str, node: yaml.Node) -> None:
        self.tag, self.node = tag, node


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_multi_constructor("!", lambda loader, suffix, node: Tagged("!" + suffix, node))
_Dumper.add_representer(Tagged, lambda dumper, value: value.node)


def _is_remote(value: str) -> bool:
    return "://" in value or value.startswith("hf://")


def _exists(base: Path, value: str) -> bool:
    return bool(glob.glob(str(base / value))) if glob.has_magic(value) else (base / value).exists()


def _resolved(value: str, base: Path, what: str, yaml_path: Path, must_exist: bool) -> str:
    """``value`` made absolute if it names something relative to ``base``; otherwise as it was
    (lm-eval reads it relative to the working directory), or a ConfigError when it must exist."""
    if _is_remote(value) or os.path.isabs(value):
        return value
    if _exists(base, value):
        return str((base / value).absolute())
    if must_exist and not _exists(Path.cwd(), value):
        raise ConfigError(f"{yaml_path}: {what}={value!r} exists neither beside the YAML ({base}) nor in the working "
                          "directory; give a path relative to the YAML or an absolute one")
    return value


def _resolve_files(value: Any, base: Path, yaml_path: Path, must_exist: bool) -> Any:
    """``data_files`` as ``datasets`` accepts it: a path, a list of paths, or split -> path(s)."""
    if isinstance(value, str):
        return _resolved(value, base, "dataset_kwargs.data_files", yaml_path, must_exist)
    if isinstance(value, list):
        return [_resolve_files(v, base, yaml_path, must_exist) for v in value]
    if isinstance(value, dict):
        return {k: _resolve_files(v, base, yaml_path, must_exist) for k, v in value.items()}
    return value


def resolve_paths(config: dict[str, Any], yaml_path: Path, tree: Path) -> dict[str, Any]:
    """A task (or group) config with its local paths absolute; ``tree`` is the directory being mirrored."""
    base = yaml_path.parent
    out = dict(config)
    local = out.get("dataset_path") in LOCAL_BUILDERS
    if isinstance(out.get("dataset_path"), str) and not local:
        out["dataset_path"] = _resolved(out["dataset_path"], base, "dataset_path", yaml_path, must_exist=False)
    kwargs = out.get("dataset_kwargs")
    if isinstance(kwargs, dict):
        kwargs = dict(kwargs)
        if "data_files" in kwargs:
            kwargs["data_files"] = _resolve_files(kwargs["data_files"], base, yaml_path, must_exist=local)
        if isinstance(kwargs.get("data_dir"), str):
            kwargs["data_dir"] = _resolved(kwargs["data_dir"], base, "dataset_kwargs.data_dir", yaml_path, local)
        out["dataset_kwargs"] = kwargs
    include = out.get("include")
    if isinstance(include, str) and not os.path.isabs(include):
        target = (base / include).resolve()
        if target.exists() and not target.is_relative_to(tree.resolve()):
            out["include"] = str(target)  # outside the mirrored tree: the original file
    return out


def _mirror_file(source: Path, target: Path, tree: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.suffix in YAML_SUFFIXES:
        try:
            config = yaml.load(source.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 - SafeLoader subclass
        except yaml.YAMLError:
            config = None  # not ours to judge: lm-eval reports (or skips) it
        if isinstance(config, dict):
            text = yaml.dump(resolve_paths(config, source, tree), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
            target.write_text(f"# resolved from {source}\n{text}", encoding="utf-8")
            return
    target.symlink_to(source.absolute())


def resolve_task_dirs(sources: Iterable[str | Path], work_dir: Path) -> list[Path]:
    """Mirror each task directory under ``work_dir/<i>/`` (see the module docstring); returns the
    mirrors in the same order (lm-eval lets later directories override earlier ones' task names)."""
    mirrors = []
    for i, source in enumerate(sources):
        tree = Path(source).expanduser()
        if not tree.is_dir():
            raise ConfigError(f"include_path: {source} is not a directory of task YAMLs")
        mirror = work_dir / str(i)
        for path in sorted(tree.rglob("*")):
            parts = path.relative_to(tree).parts
            if path.is_dir() or any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            _mirror_file(path, mirror.joinpath(*parts), tree)
        mirror.mkdir(parents=True, exist_ok=True)
        mirrors.append(mirror)
    return mirrors


def check_task_names(names: Iterable[str], known: Iterable[str], where: str) -> None:
    """ConfigError naming each unknown task and the closest known names."""
    known = sorted(known)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"task {name!r} is not among the tasks of {where}{hint} "
                              "(add a directory of task YAMLs with include_path=...)")
