"""A run records the tokenizer it trains with (:mod:`dsl_lit.checkpoint.tokenizer`), and one started
from a checkpoint (``init_from``) or resuming one trains with the tokenizer that checkpoint recorded.

Every recipe calls :func:`record_run_tokenizer` once its tokenizer is known (pretraining: the data
module's build, after ``check_vocab``; post-training: ``tokenizer_dir``, in ``setup_posttrain``):
a tokenizer other than the one ``init_from`` or the resumed checkpoint recorded is a one-line
``ConfigError`` naming both hashes; then ``<run dir>/tokenizer/`` gets the copy every checkpoint
carries, and ``resolved_config.yaml`` the record. Post-training, whose ``tokenizer_dir`` defaults to
the data cache's (``${data.cache_dir}/tokenizer``, the cache's latest build), first takes the
starting checkpoint's recorded tokenizer in place of that default (:func:`starting_tokenizer`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from data_contract.errors import ConfigError
from dsl_lit.checkpoint.resume import resume_checkpoint
from dsl_lit.checkpoint.tokenizer import (
    RUN_TOKENIZER,
    RecordedTokenizer,
    copy_tokenizer,
    recorded_tokenizer,
    refuse_another,
    short,
    tokenizer_sha256,
)
from dsl_lit.config import TrainConfig
from dsl_lit.training.pretrained import StartingWeights
from dsl_lit.training.runs import is_launcher_process

log = logging.getLogger(__name__)


def starting_tokenizer(tokenizer_dir: str, is_default: bool, initial_state: StartingWeights | None,
                       field: str = "tokenizer_dir") -> str:
    """The tokenizer a run starting from ``initial_state`` trains with: the one its checkpoint
    recorded in place of the default ``tokenizer_dir`` (``is_default``: the config's
    ``${data.cache_dir}/tokenizer``) when that is another (or not built); a ``tokenizer_dir`` the
    user gave of another hash is a ConfigError; else ``tokenizer_dir`` (an HF directory, or a
    checkpoint recording none: with a warning, as it may not be its tokenizer)."""
    if initial_state is None or initial_state.hf is not None:
        return tokenizer_dir
    recorded = initial_state.recorded_tokenizer
    if recorded is None:
        log.warning("init_from=%s records no tokenizer (written before runs kept theirs): training with %s=%s, "
                    "which is not the one it trained with if that data cache was rebuilt since; pass %s=<dir> "
                    "with its tokenizer to be sure", initial_state.path, field, tokenizer_dir, field)
        return tokenizer_dir
    if not is_default:
        refuse_another(recorded, tokenizer_dir, field, f"init_from={initial_state.path}")
        return tokenizer_dir
    built = (Path(tokenizer_dir) / "tokenizer.json").is_file()
    if built and tokenizer_sha256(tokenizer_dir) == recorded.sha256:
        return tokenizer_dir
    if recorded.directory is None:
        raise ConfigError(
            f"init_from={initial_state.path} was trained with the tokenizer whose tokenizer.json has "
            f"{short(recorded.sha256)} ({recorded.where}), and {field}={tokenizer_dir} is "
            f"{'another' if built else 'not built'}; pass {field}=<a directory with that tokenizer.json>"
        )
    log.info("%s: the tokenizer init_from=%s recorded (%s), not %s=%s (%s)", field, initial_state.path,
             recorded.directory, field, tokenizer_dir, "another tokenizer" if built else "not built yet")
    return str(recorded.directory)


def _refuse(what: str, recorded: RecordedTokenizer, directory: Path, sha256: str, fix: str) -> ConfigError:
    return ConfigError(
        f"{what} was trained with the tokenizer whose tokenizer.json has {short(recorded.sha256)} "
        f"({recorded.where}), but this run's ({directory}) has {short(sha256)}: its token ids would mean other "
        f"tokens; {fix}"
    )


INIT_FROM_FIX = "pack this run's corpus with it (data.tokenizer_dir={copy}, with a data.cache_dir of its own)"
"""Pretraining's way out of an ``init_from`` trained with another tokenizer (``{copy}``: its copy)."""


def record_run_tokenizer(cfg: TrainConfig, tokenizer_dir: str | Path, initial_state: StartingWeights | None = None,
                         fix: str = INIT_FROM_FIX) -> dict[str, Any] | None:
    """In the launching process (the others return None: it checked and copied for them): check
    ``tokenizer_dir`` (what this run trains with) against the tokenizer ``initial_state`` recorded
    (ConfigError naming both hashes; ``fix`` says what to do, ``{copy}`` standing for its copy) and
    the one the checkpoint this run resumes recorded, then copy it to ``<run dir>/tokenizer/``
    (which every checkpoint then carries) and append its record to ``resolved_config.yaml``.
    Returns the record."""
    if not is_launcher_process():
        return None
    directory = Path(tokenizer_dir)
    sha256 = tokenizer_sha256(directory)
    record = {"sha256": sha256, "source": str(directory.resolve())}
    recorded = initial_state.recorded_tokenizer if initial_state is not None else None
    if initial_state is not None and recorded is not None and recorded.sha256 != sha256:
        raise _refuse(f"init_from={initial_state.path}", recorded, directory, sha256,
                      fix.replace("{copy}", str(recorded.directory or "<a directory with that tokenizer.json>")))
    resumed = resume_checkpoint(cfg.checkpoint, Path(cfg.run_dir) / "checkpoints")
    recorded = recorded_tokenizer(resumed) if resumed is not None else None
    if recorded is not None and recorded.sha256 != sha256:
        raise _refuse(f"the checkpoint it resumes, {resumed},", recorded, directory, sha256,
                      "set the data or tokenizer settings back, or train another run (a new run_name)")
    copy = copy_tokenizer(directory, Path(cfg.run_dir) / RUN_TOKENIZER, record)
    resolved = Path(cfg.run_dir) / "resolved_config.yaml"
    if resolved.is_file():
        with resolved.open("a", encoding="utf-8") as f:
            f.write("# the tokenizer this run trains with: its tokenizer.json's hash and the copy its checkpoints carry\n")
            f.write(yaml.safe_dump({"run_tokenizer": {**record, "copy": str(copy)}}, sort_keys=False))
    log.info("tokenizer: %s (%s), copied to %s", directory, short(sha256), copy)
    return record
