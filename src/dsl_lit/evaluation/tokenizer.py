"""A tokenizer directory (``tokenizer.json`` and transformers' configs beside it) read the way
lm-eval's ``hf`` backend reads it through ``transformers.AutoTokenizer``, with the ``tokenizers``
library alone (transformers is a test dependency here, not a runtime one).

What has to agree for our scores to equal the ``hf`` backend's: encoding applies the tokenizer's
own post-processor (the ``add_special_tokens=True`` default), decoding skips special tokens, and
the begin/end-of-sequence tokens are the ones ``tokenizer_config.json`` names (our DeepSeek names
when a directory has no config).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from data_contract.format import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TOKENIZER_FILE

_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _token_text(value: Any) -> str | None:
    """A special token as transformers' configs spell it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class EvalTokenizer:
    def __init__(self, tokenizer: Tokenizer, bos: str | None, eos: str, pad: str | None, name: str = "") -> None:
        self.tokenizer = tokenizer
        self.name = name
        ids = {kind: tokenizer.token_to_id(token) if token else None for kind, token in
               (("bos", bos), ("eos", eos), ("pad", pad))}
        if ids["eos"] is None:
            raise ValueError(f"the tokenizer {name or ''} has no end-of-sequence token {eos!r}")
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int = ids["eos"]
        self.pad_id: int = ids["pad"] if ids["pad"] is not None else ids["eos"]

    @classmethod
    def from_dir(cls, directory: str | Path) -> EvalTokenizer:
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: point tokenizer_dir at a directory with {TOKENIZER_FILE}")
        names: dict[str, str | None] = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
        for config in reversed(_CONFIG_FILES):  # tokenizer_config.json wins, as in transformers
            if (directory / config).is_file():
                values = json.loads((directory / config).read_text(encoding="utf-8"))
                names.update({k: _token_text(values[k]) for k in names if k in values})
        return cls(Tokenizer.from_file(str(path)), names["bos_token"], names["eos_token"] or EOS_TOKEN,
                   names["pad_token"], name=str(directory))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)
