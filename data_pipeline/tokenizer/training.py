"""Train a DeepSeek byte-level BPE tokenizer with Hugging Face ``tokenizers``.

Why specs: a tokenizer meant to stand in for DeepSeek's must pre-tokenize, decode and place its
added tokens exactly as the release does; only the vocabulary and merges are learned from the
corpus. ``tokenizer.spec`` picks the released DeepSeek LLM or DeepSeek-V3 spec
(``data_pipeline/tokenizer/spec.py``), or ``bundled``: the demo's own pre-tokenizer (below) and 15
special tokens at ids 0..14. The output directory loads with
``transformers.AutoTokenizer.from_pretrained`` (no transformers import is needed here) and carries
``meta.json`` with the ids and the padded embedding size the model needs. Stage
``train_tokenizer`` (``data_pipeline/stages/train_tokenizer.py``, settings: the ``tokenizer``
section) trains it on a run's ``kept/`` documents into ``output_dir/tokenizer``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, pre_tokenizers, trainers

from data_contract.format import META_FILE, TOKENIZER_FILE
from data_contract.tokenizer_dir import (
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    padded_vocab_size,
    token_string,
)
from data_pipeline.io.shards import building_dir
from data_pipeline.tokenizer.spec import (
    BUNDLED,
    TokenizerSpec,
    bundled_spec,
    finish,
    load_spec,
    untrained_tokenizer,
)

log = logging.getLogger(__name__)

# The bundled demo tokenizer's pre-tokenizer (the released specs carry their own).
# Horizontal whitespace: a leading space may join a word, but a newline never does.
_HSPACE = r"[^\S\r\n]"
_CJK = r"\p{Han}\p{Hangul}\p{Hiragana}\p{Katakana}"
# Alternatives are tried left to right at each position, so newlines always stand alone.
PRETOKENIZE_PATTERN = "|".join(
    [
        r"[\r\n]",  # each line break on its own
        rf"{_HSPACE}?[\p{{L}}\p{{M}}&&[^{_CJK}]]+",  # a word (Latin, Greek, Cyrillic, ...) + one space
        rf"{_HSPACE}?[\p{{P}}\p{{S}}]+",  # a run of punctuation / symbols + one space
        rf"{_HSPACE}+$",  # whitespace at the end of a line
        rf"[{_CJK}]+",  # runs of CJK ideographs, kana and Hangul
        r"\p{N}+",  # numbers (split into single digits by the Digits step)
    ]
)


def build_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The bundled spec's: regex split, then single digits, then bytes mapped to printable characters."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_spec(name: str, special_tokens: list[str] | None = None) -> TokenizerSpec:
    """The spec ``tokenizer.spec`` names (``special_tokens`` replaces the bundled spec's 15)."""
    if name == BUNDLED:
        return bundled_spec(json.loads(build_pre_tokenizer().__getstate__()), special_tokens)
    return load_spec(name)


def sample_texts(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Yield a deterministic sample of about ``max_bytes`` UTF-8 bytes, or everything when ``None``.

    Keeps the documents with the smallest content hashes that fit in the budget together (the
    longest prefix in hash order): independent of input order and of the machine, uniform over
    documents, and memory bounded by ``max_bytes``.
    """
    if max_bytes is None:
        yield from texts
        return
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    heap: list[tuple[int, str]] = []  # max-heap on the hash (stored negated)
    cutoff: int | None = None  # every hash >= cutoff is out, whenever it arrives
    total = 0
    for text in texts:
        key = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")
        if cutoff is not None and key >= cutoff:
            continue
        heapq.heappush(heap, (-key, text))
        total += len(text.encode("utf-8"))
        while total > max_bytes and heap:
            cutoff = -heap[0][0]
            while heap and -heap[0][0] == cutoff:  # equal hashes (duplicate texts) leave together
                total -= len(heapq.heappop(heap)[1].encode("utf-8"))
    if not heap:
        raise ValueError(f"max_bytes={max_bytes} is smaller than any single document; raise it")
    for _, text in sorted(heap, reverse=True):  # ascending hash order
        yield text


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    output_dir: Path,
    spec: TokenizerSpec | None = None,
    max_bytes: int | None = None,
    embedding_size: int | None = None,
) -> Path:
    """Train BBPE on ``texts`` and write a loadable tokenizer directory; returns ``output_dir``.

    ``spec``: what is not learned (default: the bundled one). ``vocab_size`` is the BPE vocabulary
    to learn, including the spec's added tokens that sit inside it (the bundled 15; V3's bos, eos,
    pad); a released spec's other added tokens follow at their released ids. ``embedding_size`` is
    the model's embedding rows written to meta.json as ``padded_vocab_size`` (DeepSeek LLM: 102400
    for 100015 tokens); ``None`` rounds the vocab up to a multiple of 128. The directory appears
    atomically: it is built under a temporary name and renamed when complete.
    """
    spec = spec or tokenizer_spec(BUNDLED)
    specials = spec.in_vocab_tokens
    min_vocab = 256 + len(specials)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet + specials ({min_vocab})")
    if spec.bpe_vocab_size is not None and vocab_size > spec.bpe_vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is above {spec.name}'s BPE vocabulary ({spec.bpe_vocab_size}), "
                         "where its added tokens start")
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)

    tokenizer = untrained_tokenizer(spec)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=spec.byte_alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(sample_texts(texts, max_bytes), trainer=trainer)
    learned = tokenizer.get_vocab_size()
    if learned < vocab_size:
        log.warning("corpus too small: trained %d of %d requested tokens", learned, vocab_size)
    tokenizer = finish(tokenizer, spec)
    if embedding_size is not None and embedding_size < tokenizer.get_vocab_size():
        raise ValueError(f"embedding_size={embedding_size} is below the {tokenizer.get_vocab_size()} tokens")

    names = {key: token_string(spec.tokenizer_config.get(key)) for key in ("bos_token", "eos_token", "pad_token")}
    meta = {
        "vocab_size": tokenizer.get_vocab_size(),
        "padded_vocab_size": embedding_size or padded_vocab_size(tokenizer.get_vocab_size()),
        "bos_id": tokenizer.token_to_id(names["bos_token"]),
        "eos_id": tokenizer.token_to_id(names["eos_token"]),
        "pad_id": tokenizer.token_to_id(names["pad_token"]),
        "requested_vocab_size": vocab_size,
        "max_bytes": max_bytes,
        "spec": spec.name,
        "learned_vocab_size": learned,
    }
    files: list[tuple[str, dict[str, Any]]] = [(TOKENIZER_CONFIG, spec.tokenizer_config)]
    if spec.special_tokens_map is not None:
        files.append((SPECIAL_TOKENS_MAP, spec.special_tokens_map))
    files.append((META_FILE, meta))  # last: its presence marks a complete directory

    with building_dir(output_dir) as tmp_dir:
        tokenizer.save(str(tmp_dir / TOKENIZER_FILE))
        for name, obj in files:
            (tmp_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    log.info(
        "tokenizer: %d tokens (embedding %d) -> %s", meta["vocab_size"], meta["padded_vocab_size"], output_dir
    )
    return output_dir
