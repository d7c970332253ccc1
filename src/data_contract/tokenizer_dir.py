"""A tokenizer directory, ours or a released one: its ids, embedding size, special tokens and chat template.

Why one reader: the data pipeline writes ``meta.json`` beside the tokenizers it trains, but a
tokenizer published with a model (DeepSeek LLM, V3, R1, or any Hugging Face repository) has only
``tokenizer.json``, ``tokenizer_config.json`` and maybe ``config.json``. Packing needs the EOS id
and the dtype, the trainer the vocabulary size, chat formatting the bos/eos strings and the
template: all of them are read here, the same way wherever a tokenizer directory is accepted
(``tokenizer.path``, ``data.tokenizer_dir``, ``tokenizer_dir``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data_contract.errors import ConfigError
from data_contract.format import META_FILE, TOKENIZER_FILE

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where newer releases keep the template
MAX_TEMPLATE_CHARS = 1_000_000
"""A chat template larger than this is refused (DeepSeek-V3's is ~3,000 characters)."""
MODEL_CONFIG = "config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_FILE)
"""What a copy of a tokenizer directory carries (meta.json is written, not copied)."""
EMBEDDING_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, multiple: int = EMBEDDING_MULTIPLE) -> int:
    """Embedding rows: the vocab rounded up to a multiple of 128 so matmuls and TP shards stay aligned.

    (DeepSeek LLM padded its 100015 tokens further, to 102400, and V3 its 128815 to 129280.)
    """
    return -(-vocab_size // multiple) * multiple


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file ({} when absent); a ConfigError naming the file when it is not one."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); is it truncated? Copy the file again") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__} where a JSON object belongs")
    return data


def token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def check_tokenizer_dir(directory: str | Path, field: str) -> Path:
    """``directory`` as a Path if it holds tokenizer.json, else ``ValueError`` naming ``field``."""
    path = Path(directory)
    if not (path / TOKENIZER_FILE).is_file():
        raise ValueError(f"{field}={directory} has no {TOKENIZER_FILE}: point it at a tokenizer directory "
                         "(a model's Hugging Face directory, or a data-pipeline output's tokenizer/)")
    return path


def special_tokens(directory: str | Path) -> dict[str, str | None]:
    """``bos_token``, ``eos_token``, ``pad_token``, ``unk_token`` from tokenizer_config.json, else
    special_tokens_map.json (None where neither names one)."""
    config = _read_json(Path(directory) / TOKENIZER_CONFIG)
    mapping = _read_json(Path(directory) / SPECIAL_TOKENS_MAP)
    keys = ("bos_token", "eos_token", "pad_token", "unk_token")
    return {key: token_string(config.get(key)) or token_string(mapping.get(key)) for key in keys}


def chat_template(directory: str | Path, name: str | None = None) -> str | None:
    """The directory's chat template: chat_template.jinja, else tokenizer_config.json's
    ``chat_template``: a string, or named templates of which ``name`` (None: ``default``) is used,
    as transformers' ``apply_chat_template(chat_template=name)`` does; None without any. A name the
    directory lacks is a ValueError listing the names."""
    path = Path(directory) / CHAT_TEMPLATE_FILE
    if path.is_file() and name is None:
        return read_template_file(path)
    template = _read_json(Path(directory) / TOKENIZER_CONFIG).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        wanted = name or "default"
        if wanted not in named:
            raise ValueError(
                f"{Path(directory) / TOKENIZER_CONFIG} has named chat templates {sorted(map(str, named))} and none "
                f"called {wanted!r}; pick one with chat_template_name=<name>"
            )
        template = named[wanted]
    elif name is not None:
        raise ValueError(f"chat_template_name={name!r}: {Path(directory) / TOKENIZER_CONFIG} has no named chat "
                         "templates; leave chat_template_name unset")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{Path(directory) / TOKENIZER_CONFIG}: chat_template must be a string or a list of "
                         f"{{name, template}}, not {type(template).__name__}")
    if template is not None and len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{Path(directory) / TOKENIZER_CONFIG}: its chat template has {len(template)} characters, "
                         f"more than {MAX_TEMPLATE_CHARS} (released templates have a few thousand)")
    return template or None


def read_template_file(path: Path) -> str:
    """A template file, refused when larger than :data:`MAX_TEMPLATE_CHARS` bytes (before reading it)."""
    size = path.stat().st_size
    if size > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{path} has {size} bytes, more than {MAX_TEMPLATE_CHARS} for a chat template "
                         "(released templates have a few thousand)")
    return path.read_text(encoding="utf-8")


def token_ids(directory: str | Path) -> dict[str, int]:
    """Every token of tokenizer.json (model vocabulary and added tokens) with its id."""
    data = _read_json(Path(directory) / TOKENIZER_FILE)
    vocab = data.get("model", {}).get("vocab") or {}
    ids = dict(vocab) if isinstance(vocab, dict) else {piece: i for i, (piece, _) in enumerate(vocab)}
    ids.update((t["content"], t["id"]) for t in data.get("added_tokens", []))
    return ids


def derive_meta(directory: str | Path) -> dict[str, Any]:
    """meta.json's ids for a directory without one: ``vocab_size`` (the largest id + 1),
    ``padded_vocab_size`` (config.json's ``vocab_size`` when the directory is a model's, else the
    vocabulary rounded up to 128), ``bos_id`` (None without a bos token), ``eos_id``, ``pad_id``
    (the eos when there is no pad token, as in DeepSeek's releases)."""
    directory = check_tokenizer_dir(directory, "tokenizer directory")
    ids = token_ids(directory)
    vocab_size = max(ids.values()) + 1
    names = special_tokens(directory)
    if names["eos_token"] is None or names["eos_token"] not in ids:
        raise ValueError(f"{directory}: {TOKENIZER_CONFIG} names no eos_token that {TOKENIZER_FILE} holds "
                         f"(got {names['eos_token']!r}); packing ends every document with it")
    eos_id = ids[names["eos_token"]]
    embedding = _read_json(directory / MODEL_CONFIG).get("vocab_size")
    return {
        "vocab_size": vocab_size,
        "padded_vocab_size": embedding if isinstance(embedding, int) and embedding >= vocab_size
        else padded_vocab_size(vocab_size),
        "bos_id": ids.get(names["bos_token"]) if names["bos_token"] else None,
        "eos_id": eos_id,
        "pad_id": ids.get(names["pad_token"], eos_id) if names["pad_token"] else eos_id,
    }


def read_tokenizer_meta(directory: str | Path) -> dict[str, Any]:
    """meta.json when the data pipeline wrote one, else :func:`derive_meta`."""
    path = Path(directory) / META_FILE
    return _read_json(path) if path.is_file() else derive_meta(directory)


def validate_tokenizer_dir(directory: str | Path, field: str) -> dict[str, Any]:
    """Everything a run will read from a tokenizer directory, checked before any work starts
    (ConfigError naming ``field`` and the file): tokenizer.json loads, the JSON files are objects,
    an eos token exists and its id (and pad/bos ids) lie inside the vocabulary. Returns its meta."""
    from tokenizers import Tokenizer

    try:
        path = check_tokenizer_dir(directory, field)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _read_json(path / TOKENIZER_FILE)  # a clear message for truncated or non-object JSON first
    try:
        Tokenizer.from_file(str(path / TOKENIZER_FILE))
    except Exception as error:  # the tokenizers library's own parse errors
        raise ConfigError(f"{field}={directory}: {TOKENIZER_FILE} does not load as a tokenizer ({error})") from None
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, MODEL_CONFIG):
        _read_json(path / name)
    try:
        meta = read_tokenizer_meta(path)
    except ValueError as error:
        raise ConfigError(f"{field}={directory}: {error}") from None
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"{field}={directory}: its vocab_size {vocab!r} is not a positive integer")
    for key in ("eos_id", "pad_id", "bos_id"):
        value = meta.get(key)
        if value is None and key == "bos_id":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
            raise ConfigError(f"{field}={directory}: {key}={value!r} is not a token id of its {vocab}-token "
                              "vocabulary; fix tokenizer_config.json (or meta.json)")
    return meta
