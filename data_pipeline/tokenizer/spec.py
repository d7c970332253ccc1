"""What a trained tokenizer is besides its learned merges: the released DeepSeek tokenizers' specs.

Why specs as data: a from-scratch tokenizer that is to stand in for DeepSeek's must split text the
same way (normalizer, the exact Split/Digits/ByteLevel pre-tokenizer sequence), decode the same
way, and put every added token at its released id with its released ``special`` flag; only the
vocabulary and merges are learned. ``specs/<name>.json`` holds those facts as published
with DeepSeek LLM 7B base and DeepSeek-V3 (``tests/unit/data_pipeline/test_released_tokenizers.py`` checks them against
the reference copy of the releases); ``bundled`` is this project's demo tokenizer, built in code.

Ids: added tokens below ``bpe_vocab_size`` (V3's bos/eos/pad at 0, 1, 2) are trained as the BPE
trainer's special tokens, so they take the first ids as in the release; the others follow the
learned vocabulary (which, as released, lacks the byte characters that are added tokens). A
learned vocabulary smaller than the release's (a small ``vocab_size``, or a corpus too small for
the full one) is padded with reserved entries that no merge produces, so the added tokens keep
their released ids whatever was learned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from data_contract.format import DEEPSEEK_SPECIAL_TOKENS

SPECS_DIR = Path(__file__).resolve().parent / "specs"
RELEASED = ("deepseek_llm", "deepseek_v3")
BUNDLED = "bundled"
SPEC_NAMES = (BUNDLED, *RELEASED)


def reserved_token(token_id: int) -> str:
    """Filler at an unused id below the released BPE size. '｜' is outside the byte-level alphabet,
    so no merge ever produces it and no text encodes to it."""
    return f"<｜reserved▁{token_id}｜>"


@dataclass(frozen=True)
class TokenizerSpec:
    name: str
    pre_tokenizer: dict[str, Any]
    decoder: dict[str, Any]
    added_tokens: list[dict[str, Any]]
    """``{"id", "content", "special"}`` in id order."""
    tokenizer_config: dict[str, Any]
    """tokenizer_config.json, written as it is (the released ones carry bos/eos/pad, model_max_length
    and the chat template)."""
    special_tokens_map: dict[str, Any] | None = None
    """special_tokens_map.json (the releases ship none: their tokenizer_config names the tokens)."""
    normalizer: dict[str, Any] | None = None
    post_processor: dict[str, Any] | None = None
    bpe_vocab_size: int | None = None
    """The released BPE vocabulary (incl. the in-vocabulary added tokens); None: no fixed size."""
    embedding_size: int | None = None
    """The released model's embedding rows (config.json ``vocab_size``)."""

    @property
    def byte_alphabet(self) -> list[str]:
        """The byte-level characters the BPE starts from: all 256, less those the release added as
        tokens instead (DeepSeek LLM: the 13 bytes that never occur in UTF-8, e.g. 'ö' for 0xF6,
        are added tokens 100002..100014, so they are not in its BPE vocabulary)."""
        added = {t["content"] for t in self.added_tokens}
        return [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in added]

    @property
    def in_vocab_tokens(self) -> list[str]:
        """Added tokens the BPE trainer places first (ids 0..k-1)."""
        limit = self.bpe_vocab_size if self.bpe_vocab_size is not None else float("inf")
        return [t["content"] for t in self.added_tokens if t["id"] < limit]


def load_spec(name: str) -> TokenizerSpec:
    """A released spec from ``specs/<name>.json``."""
    if name not in RELEASED:
        raise ValueError(f"unknown released tokenizer spec {name!r}; known: {list(RELEASED)}")
    raw = json.loads((SPECS_DIR / f"{name}.json").read_text(encoding="utf-8"))
    return TokenizerSpec(
        name=name,
        pre_tokenizer=raw["pre_tokenizer"],
        decoder=raw["decoder"],
        added_tokens=raw["added_tokens"],
        tokenizer_config=raw["tokenizer_config"],
        normalizer=raw["normalizer"],
        post_processor=raw["post_processor"],
        bpe_vocab_size=raw["bpe_vocab_size"],
        embedding_size=raw["embedding_size"],
    )


def bundled_spec(pre_tokenizer: dict[str, Any], special_tokens: list[str] | None = None) -> TokenizerSpec:
    """The demo tokenizer: our pre-tokenizer and ``special_tokens`` (bos, eos, pad first) at ids 0.."""
    tokens = list(special_tokens or DEEPSEEK_SPECIAL_TOKENS)
    if len(tokens) < 3:
        raise ValueError("special_tokens must start with bos, eos and pad")
    named = {"bos_token": tokens[0], "eos_token": tokens[1], "pad_token": tokens[2]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "add_bos_token": False,
        "add_eos_token": False,
        # Spaces are data in byte-level BPE: never "clean" them, or decode(encode(x)) != x.
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": tokens[3:],
    }
    return TokenizerSpec(
        name=BUNDLED,
        pre_tokenizer=pre_tokenizer,
        decoder=json.loads(decoders.ByteLevel().__getstate__()),  # the library's defaults, as before
        added_tokens=[{"id": i, "content": t, "special": True} for i, t in enumerate(tokens)],
        tokenizer_config=config,
        special_tokens_map={**named, "additional_special_tokens": tokens[3:]},
    )


def untrained_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """An empty BPE with the spec's normalizer, pre-tokenizer, post-processor and decoder, ready to train."""
    tokenizer = Tokenizer(models.BPE())
    skeleton = json.loads(tokenizer.to_str())
    skeleton.update(
        normalizer=spec.normalizer,
        pre_tokenizer=spec.pre_tokenizer,
        post_processor=spec.post_processor,
        decoder=spec.decoder,
    )
    return Tokenizer.from_str(json.dumps(skeleton))


def _added_token(token: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json's entry: the spec's id, content and special flag; never stripped or word-bound."""
    return {
        "id": token["id"],
        "content": token["content"],
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": not token["special"],
        "special": token["special"],
    }


def finish(trained: Tokenizer, spec: TokenizerSpec) -> Tokenizer:
    """The trained BPE with reserved fillers up to ``bpe_vocab_size`` and every added token at its id.

    Raises ``ValueError`` when an id cannot be honoured (a learned vocabulary above the released one).
    """
    data = json.loads(trained.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    learned = len(vocab)
    if spec.bpe_vocab_size is not None:
        if learned > spec.bpe_vocab_size:
            raise ValueError(f"learned {learned} tokens, more than {spec.name}'s {spec.bpe_vocab_size}")
        vocab.update((reserved_token(i), i) for i in range(learned, spec.bpe_vocab_size))
    in_vocab = [t for t in spec.added_tokens if t["id"] < len(vocab)]
    after = [t for t in spec.added_tokens if t["id"] >= len(vocab)]
    if [t["id"] for t in after] != list(range(len(vocab), len(vocab) + len(after))):
        raise ValueError(f"{spec.name}: the added tokens above the BPE vocabulary must have consecutive ids "
                         f"from {len(vocab)}")
    data["added_tokens"] = [_added_token(t) for t in in_vocab + after]
    tokenizer = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    wrong = [t["content"] for t in spec.added_tokens if tokenizer.token_to_id(t["content"]) != t["id"]]
    if wrong:
        raise ValueError(f"{spec.name}: added tokens {wrong[:5]} did not land on their ids")
    return tokenizer
