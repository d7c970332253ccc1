"""Fill-in-the-middle at the document level (DeepSeek-V3 section 4.1, from DeepSeekCoder-V2).

A share ``fim_rate`` of the documents is cut at two random character positions into prefix,
middle and suffix, and packed as Prefix-Suffix-Middle, ``<｜fim▁begin｜> prefix <｜fim▁hole｜>
suffix <｜fim▁end｜> middle`` (the packer appends EOS), or, for a share ``fim_spm_rate`` of those,
Suffix-Prefix-Middle, ``<｜fim▁begin｜><｜fim▁hole｜> suffix <｜fim▁end｜> prefix middle``. The
model still learns next-token prediction on the rearranged stream; at inference it fills a hole.

Each document's draws come from its own generator seeded by (seed, shard, row), so the result
does not depend on batching or on the number of worker processes, and a rebuild is identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from data_contract.errors import ConfigError
from data_contract.format import FIM_BEGIN_TOKEN, FIM_END_TOKEN, FIM_HOLE_TOKEN, FIM_TOKENS


@dataclass(frozen=True)
class FIMPlan:
    """What happens to one document: ``None`` cuts (plain), or (i, j, spm)."""

    cuts: tuple[int, int] | None
    spm: bool = False


def plan_document(text: str, rate: float, spm_rate: float, seed: int, shard: int, row: int) -> FIMPlan:
    """The FIM decision for document ``row`` of ``shard``: deterministic in (seed, shard, row)."""
    if rate <= 0.0 or not text:
        return FIMPlan(None)
    rng = np.random.Generator(np.random.PCG64([seed, shard, row]))
    if rng.random() >= rate:
        return FIMPlan(None)
    i, j = sorted(int(x) for x in rng.integers(0, len(text) + 1, size=2))
    return FIMPlan((i, j), spm=bool(rng.random() < spm_rate))


def fim_token_ids(tokenizer: Tokenizer, field: str = "pack.fim_rate") -> tuple[int, int, int]:
    """(begin, hole, end) ids; ConfigError naming ``field`` when the tokenizer lacks them."""
    ids = [tokenizer.token_to_id(name) for name in FIM_TOKENS]
    missing = [name for name, i in zip(FIM_TOKENS, ids) if i is None]
    if missing:
        raise ConfigError(f"{field} > 0 needs the tokenizer's fill-in-the-middle tokens; it lacks {missing}: "
                          f"use a tokenizer with them (DeepSeek's have them) or set {field}=0")
    begin, hole, end = ids
    return begin, hole, end


def encode_documents(tokenizer: Tokenizer, texts: list[str], plans: list[FIMPlan],
                     fim_ids: tuple[int, int, int] | None) -> list[list[int]]:
    """Token ids of each document, FIM-rearranged where its plan cuts it (pieces encoded apart,
    so no token spans a cut)."""
    pieces: list[str] = []
    for text, plan in zip(texts, plans):
        if plan.cuts is None:
            pieces.append(text)
        else:
            i, j = plan.cuts
            pieces += [text[:i], text[i:j], text[j:]]
    encoded = [e.ids for e in tokenizer.encode_batch(pieces, add_special_tokens=False)]
    out, k = [], 0
    for plan in plans:
        if plan.cuts is None:
            out.append(encoded[k])
            k += 1
            continue
        prefix, middle, suffix = encoded[k : k + 3]
        k += 3
        begin, hole, end = fim_ids
        if plan.spm:
            out.append([begin, hole, *suffix, end, *prefix, *middle])
        else:
            out.append([begin, *prefix, hole, *suffix, end, *middle])
    return out


__all__ = ["FIM_BEGIN_TOKEN", "FIM_END_TOKEN", "FIM_HOLE_TOKEN", "FIMPlan", "encode_documents", "fim_token_ids",
           "plan_document"]
