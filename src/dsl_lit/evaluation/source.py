"""What ``recipes/evaluate.py checkpoint=...`` names, loaded as a whole fp32 Transformer on one
device, with the tokenizer that goes with it.

A Hugging Face directory (config.json) is read by ``dsl_lit.hf.from_pretrained``; anything else
is one of our checkpoints (a step-<N> directory, or a run directory: its latest complete step)
read by ``dsl_lit.checkpoint.reader``, whatever layout wrote it. The tokenizer, unless named: the
HF directory's own files, or the one the run trained with (the copy it recorded,
:func:`dsl_lit.checkpoint.tokenizer.checkpoint_tokenizer`: a named tokenizer of another hash is
refused; a checkpoint recording none falls back on its config's, with a warning).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data_contract.errors import ConfigError
from data_contract.format import TOKENIZER_FILE
from dsl_lit.checkpoint.reader import find_checkpoint, load_checkpoint_model
from dsl_lit.checkpoint.tokenizer import checkpoint_tokenizer
from dsl_lit.hf import from_pretrained
from dsl_lit.models import Transformer


@dataclass
class EvalModel:
    model: Transformer
    tokenizer_dir: Path | None
    """The tokenizer to read it with: the one given, else where the source says its tokenizer is
    (None: it does not say)."""
    info: dict[str, Any]
    """For results.json: what was evaluated (path, step, family, parameters)."""


def load_eval_model(source: str | Path, weights: str = "model", device: str | torch.device = "cpu",
                    tokenizer_dir: str | Path | None = None, field: str = "tokenizer_dir") -> EvalModel:
    """``source`` loaded, with its tokenizer: ``tokenizer_dir`` (the user's ``field``) when given,
    refused for one of our checkpoints that recorded another one (before the weights are read)."""
    directory = Path(source)
    if (directory / "config.json").is_file():
        if weights != "model":
            raise ConfigError(f"weights={weights} needs one of our checkpoints; {source} is a Hugging Face directory")
        model, _ = from_pretrained(directory, dtype="fp32", device=device)
        tokenizer = Path(tokenizer_dir) if tokenizer_dir else directory if (directory / TOKENIZER_FILE).is_file() else None
        info = {"checkpoint": str(directory.resolve()), "format": "huggingface"}
    else:
        step = find_checkpoint(directory)
        tokenizer = checkpoint_tokenizer(step, tokenizer_dir, field)
        model, info = load_checkpoint_model(step, weights=weights, dtype="fp32")
        model = model.to(device)
        info = {**info, "format": "dsl_lit"}
    info.update(family=model.config.family, num_params=model.num_params(), max_seq_len=model.config.max_seq_len)
    return EvalModel(model.eval(), tokenizer, info)
