"""Export a training checkpoint as a Hugging Face model directory (``recipes/export_hf.py``).

The model is rebuilt from the checkpoint's ``config.yaml``, its weights read from the safetensors
shards (whatever layout wrote them) and written by :func:`dsl_lit.hf.save_pretrained`; the run's
tokenizer files (the copy it recorded, :mod:`dsl_lit.checkpoint.tokenizer`) go beside them, so
``AutoTokenizer`` and ``AutoModelForCausalLM`` both load the directory, and their bos/eos/pad ids go into config.json and generation_config.json
(:mod:`dsl_lit.hf.token_ids`), so that ``generate`` stops on the tokenizer's eos. It appears only
once complete.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from data_contract.errors import ConfigError
from data_contract.fs import publish_dir
from data_contract.tokenizer_dir import TOKENIZER_FILES
from dsl_lit.checkpoint.reader import WEIGHT_SOURCES, find_checkpoint, load_checkpoint_model
from dsl_lit.checkpoint.tokenizer import checkpoint_tokenizer
from dsl_lit.hf.io import resolve_dtype, save_pretrained
from dsl_lit.hf.token_ids import hf_token_ids, write_token_ids

log = logging.getLogger(__name__)


def run_tokenizer_dir(checkpoint: Path, given: str | Path | None = None) -> Path | None:
    """The tokenizer the checkpoint's run trained with: the copy it recorded (``given``, the user's
    ``tokenizer_dir``, only if it is that tokenizer: else a ConfigError naming both hashes); for a
    checkpoint written before runs recorded theirs, ``given``, else post-training's
    ``tokenizer_dir``, ``data.tokenizer_dir`` or the data cache's, with a warning (None if gone).
    :func:`dsl_lit.checkpoint.tokenizer.checkpoint_tokenizer`."""
    return checkpoint_tokenizer(checkpoint, given, "tokenizer_dir")


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
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write ``checkpoint`` as a Hugging Face model directory at ``output``; returns it.

    The directory is written beside ``output`` and renamed into place once complete. An existing
    non-empty ``output`` is replaced only with ``overwrite``. ``fp8``: the family's quantised
    release format (``save_pretrained(..., fp8=True)``: V3's block FP8, V4's with FP4 experts). ``tokenizer_dir``: the tokenizer to pack
    (None: the one the run recorded; one of another hash is refused, :func:`run_tokenizer_dir`).
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

    tokenizer = run_tokenizer_dir(directory, tokenizer_dir)  # before the weights are read: a refusal is quick
    model, info = load_checkpoint_model(directory, weights=weights, dtype=dtype)
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
