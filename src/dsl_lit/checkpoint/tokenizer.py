"""The tokenizer a run trained with, kept with the run and its checkpoints, and found again by its readers.

Why: ``<data.cache_dir>/tokenizer`` points at the cache's latest build, so once the same cache dir
is built for another corpus (or tokenizer), a checkpoint's config (which names only
``data.cache_dir``) leads evaluation, the HF export and ``init_from`` to another tokenizer, silently:
the token ids the weights learned then mean other tokens (an earlier run evaluated at 5.73 bits per
byte instead of 3.92). So a run keeps its own:

- at start-up, ``<run dir>/tokenizer/``: a copy of the tokenizer directory it trains with
  (tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja, meta.json) and
  ``run_tokenizer.json``, its record: ``sha256`` (of tokenizer.json, the token <-> id mapping the
  weights are trained against, as the packed shards record it) and ``source`` (where it was copied
  from); the record is also appended to ``resolved_config.yaml`` (``run_tokenizer``);
- every checkpoint: ``step-<N>/tokenizer/``, a copy of that (under ``meta.json``'s checksums, so a
  step directory carried elsewhere keeps its tokenizer) and the record as ``meta.json``'s ``tokenizer``.

Readers (:func:`checkpoint_tokenizer`) use the recorded copy; a tokenizer they are given whose
tokenizer.json has another hash is a one-line ``ConfigError`` naming both. Checkpoints written
before runs recorded their tokenizer keep the old lookup (the config's ``tokenizer_dir``,
``data.tokenizer_dir``, else ``<data.cache_dir>/tokenizer``), with a warning.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from data_contract.errors import ConfigError
from data_contract.format import META_FILE, TOKENIZER_DIR, TOKENIZER_FILE, file_sha256
from data_contract.fs import publish_dir
from data_contract.tokenizer_dir import TOKENIZER_FILES, read_tokenizer_meta
from dsl_lit.checkpoint.files import CONFIG, META

log = logging.getLogger(__name__)

RUN_TOKENIZER = "tokenizer"
"""``<run dir>/tokenizer/`` and ``step-<N>/tokenizer/``: the copies."""
RECORD_FILE = "run_tokenizer.json"
"""In a copy: ``{"sha256": ..., "source": ...}``."""
META_KEY = "tokenizer"
"""The record's key in a checkpoint's ``meta.json``."""


def tokenizer_sha256(directory: str | Path) -> str:
    """The content hash a run records: SHA-256 of the directory's tokenizer.json."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise ConfigError(f"{directory} has no {TOKENIZER_FILE}: point it at a tokenizer directory")
    return file_sha256(path)


def short(sha256: str) -> str:
    return f"sha256 {sha256[:12]}"


def copy_tokenizer(source: str | Path, target: Path, record: dict[str, Any]) -> Path:
    """Copy ``source``'s tokenizer files (and its meta.json, derived when it has none) to ``target``
    with ``record`` beside them; ``target`` appears whole, replacing an older copy."""
    source, target = Path(source), Path(target)
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
        if (source / META_FILE).is_file():
            shutil.copyfile(source / META_FILE, tmp / META_FILE)
        else:  # a released tokenizer's ids, as the readers derive them (config.json's embedding size included)
            (tmp / META_FILE).write_text(json.dumps(read_tokenizer_meta(source), indent=2))
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1))
        publish_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def copy_into_checkpoint(run_dir: Path, checkpoint_tmp: Path) -> None:
    """A checkpoint being written under ``run_dir/checkpoints/``: copy the run's tokenizer into it
    (nothing when the run recorded none: a run of a recipe that does not, or of a test)."""
    copy = run_dir / RUN_TOKENIZER
    if (copy / RECORD_FILE).is_file():
        shutil.copytree(copy, checkpoint_tmp / RUN_TOKENIZER)


def checkpoint_record(checkpoint_tmp: Path) -> dict[str, Any] | None:
    """The record a checkpoint being written carries (for its ``meta.json``), None without a copy."""
    path = checkpoint_tmp / RUN_TOKENIZER / RECORD_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


@dataclass(frozen=True)
class RecordedTokenizer:
    """What a checkpoint says it was trained with."""

    checkpoint: Path
    sha256: str
    source: str
    """Where the run copied it from (for messages: it may have changed since)."""
    directory: Path | None
    """A copy whose tokenizer.json still has :attr:`sha256` (the checkpoint's, else its run dir's);
    None: both are gone or altered."""

    @property
    def where(self) -> str:
        return str(self.directory) if self.directory else f"its copy in {self.checkpoint / RUN_TOKENIZER} is missing"


def recorded_tokenizer(checkpoint: str | Path) -> RecordedTokenizer | None:
    """The tokenizer a ``step-<N>`` directory records (None: written before runs recorded theirs)."""
    checkpoint = Path(checkpoint)
    try:
        meta = json.loads((checkpoint / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    record = meta.get(META_KEY) if isinstance(meta, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        return None
    found = None
    for copy in (checkpoint / RUN_TOKENIZER, checkpoint.parent.parent / RUN_TOKENIZER):
        if (copy / TOKENIZER_FILE).is_file() and file_sha256(copy / TOKENIZER_FILE) == record["sha256"]:
            found = copy
            break
    return RecordedTokenizer(checkpoint, record["sha256"], str(record.get("source", "")), found)


def config_tokenizer_dir(checkpoint: Path) -> Path | None:
    """Where a checkpoint's config says its tokenizer is (the lookup before runs recorded theirs):
    post-training's ``tokenizer_dir``, else ``data.tokenizer_dir``, else ``<data.cache_dir>/tokenizer``
    (which is the cache's latest build); None if none holds a tokenizer.json."""
    try:
        raw = yaml.safe_load((checkpoint / CONFIG).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return None
    raw = raw if isinstance(raw, dict) else {}
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    for candidate in (raw.get("tokenizer_dir"), data.get("tokenizer_dir"),
                      data.get("cache_dir") and Path(data["cache_dir"]) / TOKENIZER_DIR):
        if candidate and (Path(candidate) / TOKENIZER_FILE).is_file():
            return Path(candidate)
    return None


def refuse_another(recorded: RecordedTokenizer, given: str | Path, field: str, what: str | None = None) -> None:
    """ConfigError (one line, both hashes) unless ``given``'s tokenizer.json is the recorded one."""
    given_sha = tokenizer_sha256(given)
    if given_sha != recorded.sha256:
        raise ConfigError(
            f"{field}={given} is not the tokenizer {what or recorded.checkpoint} was trained with: its tokenizer.json "
            f"has {short(given_sha)}, the run recorded {short(recorded.sha256)} ({recorded.where}); leave {field} "
            "unset to use the recorded one"
        )


def checkpoint_tokenizer(checkpoint: str | Path, given: str | Path | None = None,
                         field: str = "tokenizer_dir") -> Path | None:
    """The tokenizer directory to read ``checkpoint`` (a ``step-<N>`` directory) with.

    ``given`` (the user's ``field``): used when it is the recorded tokenizer, else a ConfigError
    naming both hashes. Not given: the recorded copy (a ConfigError when the copies are gone). A
    checkpoint recording none: ``given``, else its config's tokenizer with a warning (None if gone)."""
    checkpoint = Path(checkpoint)
    recorded = recorded_tokenizer(checkpoint)
    if recorded is None:
        if given:
            return Path(given)
        legacy = config_tokenizer_dir(checkpoint)
        if legacy is not None:
            log.warning("%s records no tokenizer (written before runs kept theirs): using %s, which is not the one "
                        "it trained with if that data cache was rebuilt since (another corpus or tokenizer); pass "
                        "%s=<dir> to choose", checkpoint, legacy, field)
        return legacy
    if given:
        refuse_another(recorded, given, field)
        return Path(given)
    if recorded.directory is None:
        raise ConfigError(
            f"{checkpoint} was trained with the tokenizer whose tokenizer.json has {short(recorded.sha256)} (copied "
            f"from {recorded.source}), but its copies ({checkpoint / RUN_TOKENIZER}, "
            f"{checkpoint.parent.parent / RUN_TOKENIZER}) are gone or altered; pass {field}=<a directory with that "
            "tokenizer.json>"
        )
    return recorded.directory
