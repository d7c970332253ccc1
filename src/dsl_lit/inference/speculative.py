"""Greedy decoding with the model's first MTP module as the draft model (DeepSeek-V3 report,
section 5.4.3), for every family that builds one (DeepSeek-V3 and V3.2's ``MTPModule``, DeepSeek-V4's
``V4MTPModule``: a whole V4 block on the residual streams).

The MTP module at position ``i`` reads the main model's last residual ``h_i`` (V4: its ``hc_mult``
streams, before their collapse) and the embedding of token ``i + 1`` and predicts token ``i + 2``.
So after the main model has produced the next token ``s_n`` (not yet fed), the MTP module drafts
``s_{n+1}``, and one forward of the main model over ``[s_n, draft]`` both checks the draft (its
prediction at ``s_n``) and predicts the token after it: an accepted draft yields two tokens per
forward. A rejected draft yields the main model's own token and the draft's cache entry is dropped.
Whatever the MTP module drafts, every emitted token is the main model's greedy choice, so the output
equals plain greedy decoding (up to fp reassociation between a 1-token and a 2-token forward, which
only matters on exact ties).

Both the main model and the MTP block keep KV caches (the block's attention keeps its keys as a main
layer of its family does: V4's sliding window reads the cached keys in its window). The module runs
through the model's own ``run_mtp`` and ``head_input``, as training's ``mtp_logits`` does, so the
draft is the trained MTP prediction. A batch accepts a draft only when every unfinished row does
(rows stay aligned in one cache); batch size 1 gets the full benefit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dsl_lit.models.common.kv_cache import KVCache


@dataclass
class DraftStats:
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    """Main-model forwards after the prompt (plain greedy needs one per token)."""

    @property
    def acceptance(self) -> float:
        return self.accepted / max(1, self.drafted)


class _MTPDrafter:
    """The first MTP module with its own KV cache, one position per main-model position."""

    def __init__(self, model: nn.Module, batch: int, total: int) -> None:
        self.model = model
        self.module = next(iter(model.mtp.values()))
        self.cache = KVCache(batch, total)

    def draft(self, residual: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
              key_valid: torch.Tensor) -> torch.Tensor:
        """MTP positions ``cache.length ..``: the main model's residual there [B, k, ...] and the
        tokens one ahead [B, k]; returns the draft for two ahead of the last position [B]."""
        model, module = self.model, self.module
        h = model.run_mtp(module, residual, model.tok_embeddings(next_tokens), next_tokens, positions, self.cache,
                          key_valid)
        self.cache.advance(residual.shape[1])
        return model.output(module.head_input(h[:, -1:]))[:, -1].float().argmax(dim=-1)


def decode_with_mtp_drafts(
    model: nn.Module,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    positions: torch.Tensor,
    prompt_length: int,
    max_new_tokens: int,
    emit: Callable[[int, torch.Tensor], bool],
) -> DraftStats:
    """Fill ``tokens[:, prompt_length:]`` greedily; ``emit(step, logits [B, vocab])`` records each
    emitted step (it writes the token, logprob and masks) and returns True to stop."""
    if not len(getattr(model, "mtp", ())):
        raise ValueError("mtp_speculative=True needs a model with an MTP module (e.g. deepseek_v3 with mtp_depth >= 1)")
    batch, total = tokens.shape
    cache = KVCache(batch, total)
    drafter = _MTPDrafter(model, batch, total)
    stats = DraftStats()

    residual = model.residual(tokens[:, :prompt_length], positions[:, :prompt_length], valid[:, :prompt_length], cache)
    step, n = 0, prompt_length  # n: positions fed to the main model; tokens[:, n] is the newest, unfed
    if emit(step, model.head(model.collapse(residual[:, -1:]))[:, -1].float()) or max_new_tokens == 1:
        return stats
    step += 1
    # MTP positions 0 .. n-1: residual h_i with token i + 1 (the last one just generated)
    draft = drafter.draft(residual, tokens[:, 1 : n + 1], positions[:, :n], valid[:, :n])
    while step < max_new_tokens:
        fed = torch.stack([tokens[:, n], draft], dim=1)
        residual = model.residual(fed, positions[:, n : n + 2], valid[:, : n + 2], cache)
        logits = model.head(model.collapse(residual)).float()
        stats.forwards += 1
        stats.drafted += 1
        first = logits[:, 0].argmax(dim=-1)
        if emit(step, logits[:, 0]):  # the main model's own token after tokens[:, n]
            break
        step += 1
        if bool((first == draft).all()) and step < max_new_tokens:
            stats.accepted += 1
            if emit(step, logits[:, 1]):
                break
            step += 1
            # MTP positions n, n+1: (h_n, token n+1), (h_{n+1}, token n+2)
            draft = drafter.draft(residual, tokens[:, n + 1 : n + 3], positions[:, n : n + 2], valid[:, : n + 2])
            n += 2
        else:
            cache.length = n + 1  # drop the draft's entries; tokens[:, n + 1] is the main model's
            draft = drafter.draft(residual[:, :1], tokens[:, n + 1 : n + 2], positions[:, n : n + 1], valid[:, : n + 1])
            n += 1
    return stats
