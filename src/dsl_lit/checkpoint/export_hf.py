"""Export a training checkpoint as a Hugging Face model directory (``recipes/export_hf.py``).

The model is rebuilt from the checkpoint's ``config.yaml``, its weights read from the safetensors
shards (whatever layout wrote them) and written by :func:`dsl_lit.hf.save_pretrained`; the run's
tokenizer files go beside them, so ``AutoTokenizer`` and ``AutoModelForCausalLM`` both load the
directory, and their bos/eos/pad ids go into config.json and generation_config.json
(:mod:`dsl_lit.hf.token_ids`), so that ``generate`` stops on the tokenizer's eos. It appears only
once complete.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import yaml

from dsl_lit.checkpoint.reader import WEIGHT_SOURCES, find_checkpoint, load_checkpoint_model
from dsl_lit.config.errors import ConfigError
from dsl_lit.data.format import TOKENIZER_DIR
from dsl_lit.data.tokenizer_dir import TOKENIZER_FILES
from dsl_lit.hf.io import resolve_dtype, save_pretrained
from dsl_lit.hf.token_ids import hf_token_ids, write_token_ids
from dsl_lit.utils.fs import publish_dir

log = logging.getLogger(__name__)


def run_tokenizer_dir(checkpoint: Path) -> Path | None:
    """The tokenizer the checkpoint's run trained with: post-training's ``tokenizer_dir``, else
    ``data.tokenizer_dir``, else the data cache's own (None if it is gone)."""
    raw = yaml.safe_load((checkpoint / "config.yaml").read_text(encoding="utf-8")) or {}
    data = raw.get("data") or {}
    for candidate in (raw.get("tokenizer_dir"), data.get("tokenizer_dir"),
                      data.get("cache_dir") and Path(data["cache_dir"]) / TOKENIZER_DIR):
        if candidate and (Path(candidate) / TOKENIZER_FILES[0]).is_file():
            return Path(candidate)
    return None


def copy_tokenizer_files(source: Path, target: Path) -> list[str]:
    """Copy the tokenizer files ``transformers`` reads (tokenizer.json, tokenizer_config.json, ...)."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


def export(
    checkpoint: str | Path,
    output: str | Path,
    dtype: Any = None,
    weights: str = "model",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    fp8: bool = False,
) -> Path:
    """Write ``checkpoint`` as a Hugging Face model directory at ``output``; returns it.

    The directory is written beside ``output`` and renamed into place once complete. An existing
    non-empty ``output`` is replaced only with ``overwrite``. ``fp8``: DeepSeek-V3's block-FP8
    release format (``save_pretrained(..., fp8=True)``).
    """
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output={output} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output={output} exists and is not empty; pass overwrite=true to replace it")
    if weights not in WEIGHT_SOURCES:  # before any reading
        raise ConfigError(f"weights={weights!r} is unknown; choose one of {WEIGHT_SOURCES}")
    resolve_dtype(dtype)
    directory = find_checkpoint(checkpoint)
    if directory.resolve().is_relative_to(out.resolve()):
        raise ConfigError(f"output={output} would replace the checkpoint {directory}; write elsewhere")

    model, info = load_checkpoint_model(directory, weights=weights, dtype=dtype)
    tokenizer = run_tokenizer_dir(directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_pretrained(model, tmp, dtype=dtype, max_shard_size=max_shard_size, fp8=fp8)
        if tokenizer is not None:
            copy_tokenizer_files(tokenizer, tmp)
            write_token_ids(tmp, hf_token_ids(tmp))
        else:
            log.warning("the run's tokenizer is gone: %s has no tokenizer files (copy them in by hand)", out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out)
    hf_config = json.loads((out / "config.json").read_text())
    log.info(
        "exported %s (step %s, weights=%s) to %s as %s, dtype %s",
        info["checkpoint"], info["global_step"], weights, out, hf_config["architectures"][0], hf_config["dtype"],
    )
    return out
