"""The data module's cache: a data-pipeline output directory, built by running the pipeline.

Why a separate program: the trainer and ``data_pipeline`` share only the packed-shard format
(``data_contract.format``). When ``data.cache_dir`` holds no current tokenizer and shards, the data
module runs ``python -m data_pipeline`` (the command ``make demo`` runs, with the tokenizer
stages only: training the bundled tokenizer, or none with ``data.tokenizer_dir``, a released
tokenizer the corpus is packed with) and then reads back its shards; a pipeline output made by hand
with more stages (dedup, filters) is used as it is when it matches the config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from filelock import FileLock

from data_contract.corpus import corpus_record
from data_contract.errors import ConfigError
from data_contract.format import META_FILE, SHARDS_DIR, TOKENIZER_DIR, TOKENIZER_FILE, file_sha256
from dsl_lit.config.data import DataConfig

log = logging.getLogger(__name__)

CONFIG_ERROR_EXIT = 2  # python -m data_pipeline's exit status for a refused config
# What the data module runs (training the tokenizer, or packing with data.tokenizer_dir); other runs are the user's.
OWN_STAGES = (["train_tokenizer", "tokenize_pack"], ["tokenize_pack"],
              ["decontaminate", "train_tokenizer", "tokenize_pack"], ["decontaminate", "tokenize_pack"])


def _read_meta(directory: Path) -> dict[str, Any] | None:
    """A build's meta.json; None when absent, or cut off or not an object (said once): the build is
    then as good as missing, so it is made again rather than a traceback."""
    path = directory / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict):
        log.warning("%s is not a complete build record (cut off or damaged): treating that build as missing", path)
        return None
    return meta


def stale_reason(cfg: DataConfig) -> str | None:
    """Why ``cfg.cache_dir`` cannot serve ``cfg`` (None: it can): the cache is keyed by the corpus
    (its content fingerprint) and by the tokenizer's settings and file."""
    cache = Path(cfg.cache_dir)
    tokenizer = _read_meta(cache / TOKENIZER_DIR)
    shards = _read_meta(cache / SHARDS_DIR)
    if tokenizer is None or shards is None:
        return "no tokenizer and shards there yet"
    if cfg.tokenizer_dir:
        if tokenizer.get("source_tokenizer_sha256") != file_sha256(Path(cfg.tokenizer_dir) / TOKENIZER_FILE):
            return f"its tokenizer is not the one in data.tokenizer_dir={cfg.tokenizer_dir}"
    elif tokenizer.get("source"):
        return f"its tokenizer is a copy of {tokenizer['source']}: set data.tokenizer_dir to use it"
    else:
        trained = (tokenizer.get("requested_vocab_size"), tokenizer.get("max_bytes"))
        if trained != (cfg.tokenizer_vocab_size, cfg.tokenizer_max_bytes):
            return f"its tokenizer was trained with (vocab_size, max_bytes) = {trained}"
    if shards.get("tokenizer_sha256") != file_sha256(cache / TOKENIZER_DIR / TOKENIZER_FILE):
        return "its shards were encoded with another tokenizer"
    stages = shards.get("stages") or []
    decontaminated = "decontaminate" in stages
    if stages in OWN_STAGES and cfg.decontaminate != decontaminated:  # a hand-made run is used as it is
        return f"its corpus was{'' if decontaminated else ' not'} decontaminated, data.decontaminate={cfg.decontaminate}"
    fim, packed = {"rate": cfg.fim_rate, "spm_rate": cfg.fim_spm_rate, "seed": cfg.seed}, shards.get("fim") or {}
    if (cfg.fim_rate or packed.get("rate")) and packed != fim:  # (without FIM the seed does not matter)
        return f"its shards were packed with fill-in-the-middle settings {packed or None}, not {fim}"
    # the content, not the path: a moved checkout (or a git worktree) reads the same corpus, and
    # the pipeline, which keys its finished work by content too, would not rebuild it
    if (shards.get("corpus") or {}).get("fingerprint") != corpus_record(cfg.corpus_dir)["fingerprint"]:
        built_from = (shards.get("corpus") or {}).get("path", "an unrecorded corpus")
        return f"it was built from {built_from} as it was then, not from data.corpus_dir as it is now"
    return None


def cache_is_current(cfg: DataConfig) -> bool:
    return stale_reason(cfg) is None


def _override(key: str, value: object) -> str:
    """A Hydra command-line override with the value quoted (paths may hold ``=``, commas, spaces)."""
    text = str(value)
    if "'" in text or "\\" in text:
        raise ConfigError(
            f"data.{key}={text!r}: quotes and backslashes cannot be passed to the data pipeline"
        )
    return f"{key}='{text}'"


def pipeline_command(cfg: DataConfig) -> list[str]:
    """``python -m data_pipeline`` over ``data.corpus_dir`` into ``data.cache_dir``: tokenizer and shards."""
    command = [
        sys.executable,
        "-m",
        "data_pipeline",
        _override("input.path", Path(cfg.corpus_dir).resolve()),
        _override("output_dir", Path(cfg.cache_dir).resolve()),
    ]
    command += [f"pack.fim_rate={cfg.fim_rate}", f"pack.fim_spm_rate={cfg.fim_spm_rate}", f"pack.fim_seed={cfg.seed}"]
    first = "decontaminate," if cfg.decontaminate else ""
    if cfg.tokenizer_dir:
        return [*command, f"stages=[{first}tokenize_pack]", _override("tokenizer.path", Path(cfg.tokenizer_dir).resolve())]
    max_bytes = "null" if cfg.tokenizer_max_bytes is None else cfg.tokenizer_max_bytes
    return [
        *command,
        f"stages=[{first}train_tokenizer,tokenize_pack]",
        "tokenizer=bundled",
        f"tokenizer.vocab_size={cfg.tokenizer_vocab_size}",
        f"tokenizer.max_bytes={max_bytes}",
        "tokenizer.padded_vocab_size=null",  # the vocab rounded up to a multiple of 128
    ]


def _pipeline_env() -> dict[str, str]:
    """This environment, with the directories holding ``data_pipeline`` and ``dsl_lit`` importable."""
    roots = []
    for name in ("data_pipeline", "dsl_lit"):
        spec = importlib.util.find_spec(name)  # locates the package without importing it
        if spec is None or spec.origin is None:
            raise RuntimeError(
                f"cannot find the {name} package to build data.cache_dir: run from the project root or "
                "install the project (pip install -e .)"
            )
        roots.append(str(Path(spec.origin).parents[1]))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*dict.fromkeys(roots), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_pipeline(cfg: DataConfig) -> None:
    """Run the pipeline's program, its output logged line by line; a failure raises with its tail."""
    command = pipeline_command(cfg)
    log.info("data: building %s with: %s", cfg.cache_dir, " ".join(command[1:]))
    tail: deque[str] = deque(maxlen=20)
    with subprocess.Popen(
        command,
        env=_pipeline_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            log.info("data_pipeline: %s", line.rstrip())
    if proc.returncode == 0:
        return
    message = (
        f"building data.cache_dir={cfg.cache_dir} from data.corpus_dir={cfg.corpus_dir} failed "
        f"(exit {proc.returncode}):\n" + "\n".join(tail)
    )
    raise ConfigError(message) if proc.returncode == CONFIG_ERROR_EXIT else RuntimeError(message)


DECONTAMINATION_RULES = "nfkd-nomarks-noignorables-confusables-casefold/1; short texts as whole documents/3"
"""``data_pipeline.stages.decontaminate.TEXT_FORM`` (dsl_lit never imports the pipeline; a test ties
the two): a decontaminated build made under other rules has another fingerprint, so it is rebuilt."""

BUILDS_DIR = "builds"
"""``<cache_dir>/builds/<settings fingerprint>/``: one pipeline output per data settings."""


def settings_fingerprint(cfg: DataConfig) -> str:
    """What a build depends on (the corpus content, the tokenizer's settings or file, FIM), hashed."""
    tokenizer: dict[str, Any] = (
        {"file": file_sha256(Path(cfg.tokenizer_dir) / TOKENIZER_FILE)} if cfg.tokenizer_dir
        else {"vocab_size": cfg.tokenizer_vocab_size, "max_bytes": cfg.tokenizer_max_bytes}
    )
    fim = {"rate": cfg.fim_rate, "spm_rate": cfg.fim_spm_rate, "seed": cfg.seed} if cfg.fim_rate else None
    payload = {"corpus": corpus_record(cfg.corpus_dir)["fingerprint"], "tokenizer": tokenizer, "fim": fim,
               **({"decontaminate": DECONTAMINATION_RULES} if cfg.decontaminate else {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def build_dir(cfg: DataConfig) -> Path:
    """The directory holding ``cfg``'s tokenizer/ and shards/: its own build under ``builds/``
    once made, else ``cache_dir`` itself (a cache built before builds existed, or by hand)."""
    cache = Path(cfg.cache_dir)
    if _holds_a_real_build(cache) and stale_reason(cfg) is None:  # a current run made by hand: used as it is
        return cache
    build = cache / BUILDS_DIR / settings_fingerprint(cfg)
    return build if (build / SHARDS_DIR / META_FILE).is_file() else cache


def _holds_a_real_build(cache: Path) -> bool:
    """``cache/shards`` is a directory of its own (a run made by hand, or before builds), not a link."""
    shards = cache / SHARDS_DIR
    return shards.is_dir() and not shards.is_symlink()


def _set_damaged_aside(build: Path) -> None:
    """A build whose record (a meta.json) is there but unreadable is moved aside, never deleted,
    so that the pipeline, whose own records say that work is done, builds it afresh."""
    records = [build / name / META_FILE for name in (TOKENIZER_DIR, SHARDS_DIR)]
    if any(r.is_file() for r in records) and any(r.is_file() and _read_meta(r.parent) is None for r in records):
        aside = build.with_name(f"damaged-{build.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        build.rename(aside)
        log.warning("data: %s had a damaged build record: moved to %s, building it again", build, aside)


def _point_at(cache: Path, build: Path) -> None:
    """Make ``cache/tokenizer`` and ``cache/shards`` (what configs name: ``${data.cache_dir}/tokenizer``)
    relative links to ``build``'s, each replaced atomically. A real directory there (a build made
    before builds existed, by the data module itself) is moved under ``builds/`` first, never deleted."""
    for name in (TOKENIZER_DIR, SHARDS_DIR):
        link = cache / name
        if link.is_dir() and not link.is_symlink():
            legacy = cache / BUILDS_DIR / f"before-builds-{time.strftime('%Y%m%d-%H%M%S')}"
            legacy.mkdir(parents=True, exist_ok=True)
            link.rename(legacy / name)
        temporary = cache / f".{name}.link"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(Path(BUILDS_DIR) / build.name / name, target_is_directory=True)
        os.replace(temporary, link)


def prepare_cache(cfg: DataConfig) -> None:
    """Make ``cfg``'s tokenizer and shards exist; concurrent callers wait for one build.

    Each data settings (corpus content, tokenizer, FIM) gets its own build in
    ``<cache_dir>/builds/<fingerprint>/``, so switching settings back and forth on one cache dir
    rebuilds only what was never built, and runs with different settings sharing the cache dir
    each read their own build (:func:`build_dir`); ``<cache_dir>/tokenizer`` and ``shards`` point at
    the latest prepared one. The lock file sits beside the cache directory.
    """
    cache = Path(cfg.cache_dir)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache.parent / f".{cache.name}.lock")):
        reason = stale_reason(cfg)
        build = cache / BUILDS_DIR / settings_fingerprint(cfg)
        if reason is None and (not build.is_dir() or _holds_a_real_build(cache)):  # current, built before builds or by hand
            stages = (_read_meta(cache / SHARDS_DIR) or {}).get("stages") or []
            if cfg.decontaminate and "decontaminate" not in stages:
                log.warning("data: %s was built by hand without the decontaminate stage (stages=%s): it may hold "
                            "the evaluation tasks' texts", cache, stages)
            return
        if reason is not None:
            stages = (_read_meta(cache / SHARDS_DIR) or {}).get("stages", OWN_STAGES[0])
            if stages not in OWN_STAGES:  # a pipeline run made by hand (dedup, filters): never redo it ours
                raise ConfigError(
                    f"data.cache_dir={cache} holds a data-pipeline run with stages={stages} that does not "
                    f"match the data config: {reason}. Rerun that pipeline (input.path=<data.corpus_dir> "
                    "output_dir=<data.cache_dir>) or set data.cache_dir to another directory"
                )
        build_cfg = dataclasses.replace(cfg, cache_dir=str(build))
        build_reason = stale_reason(build_cfg)
        if build_reason is not None:
            _set_damaged_aside(build)
            log.info("data: building %s: %s", build, reason or build_reason)
            start = time.perf_counter()
            run_pipeline(build_cfg)
            build_reason = stale_reason(build_cfg)
            if build_reason is not None:
                raise RuntimeError(f"the data pipeline finished but {build} does not match the data config: {build_reason}")
            log.info("data: trained tokenizer and packed shards in %.1fs -> %s", time.perf_counter() - start, build)
        _point_at(cache, build)
