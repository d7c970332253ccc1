"""Generation and frozen log-probs on pipeline stages: no rank holds the whole model.

RL recipes sample from the policy and score the samples under a frozen reference; under pipeline
parallelism each rank holds only its stages (:func:`dsl_lit.parallel.pipeline.prune_to_stages`).
:class:`PipelinedInference` runs one forward through them: the rank of stage 0 embeds the tokens,
each stage runs its layers (with this rank's share of the KV cache: a cache holds the layers that
write to it, so each rank's cache holds only its stages' layers) and sends the hidden states on
with a blocking point-to-point send, as the pipeline's validation pass does. Forwards are not
split into micro-batches: a decoding step is one token per sequence, and its stages run one
after the other (a rank idles while the others run theirs; vLLM's pipeline decoding overlaps
several batches to hide that, which this does not).

Only the last stage holds the head. For decoding it picks the next tokens (sampling with the
caller's generator) and broadcasts them, their log-probs and the generator's state to the other
pp ranks: every rank then holds the same sequences and the same generator, as one process would,
and the next step's stage 0 embeds them. For frozen log-probs it computes the [rows, seq] log-probs
and broadcasts those (never the [rows, seq, vocab] logits).

Tensor and expert parallelism inside the stages work as on one stage: their collectives run
within the stage's ranks, which decode the same number of steps (``generate``'s ``all_finished``).

Sampling (temperature > 0) needs an explicit ``torch.Generator``: only the last stage draws, and
it is that generator's state the other ranks take over (the global RNG would drift between
ranks). An error while picking (e.g. NaN probabilities) stops the last stage only; the others then
wait in the next broadcast until the collective timeout reports the lost rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from dsl_lit.models.common.compute_copies import refresh_compute_copies
from dsl_lit.models.common.kv_cache import KVCache

Pick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Logits [batch, vocab] -> (next tokens [batch] int64, their log-probs [batch] fp32)."""


class PipelinedInference:
    """This rank's stages of ``model`` (pruned to them) as one model for :func:`generate` and
    frozen log-probs; every rank of ``pp_group`` makes the same calls in the same order.

    ``stage_layers[s]`` are stage ``s``'s layer ids and ``owner[s]`` the pp rank holding it.
    """

    def __init__(self, model: nn.Module, stage_layers: list[list[int]], owner: dict[int, int],
                 pp_group: dist.ProcessGroup) -> None:
        self.model, self.stage_layers, self.owner, self.pp_group = model, stage_layers, owner, pp_group
        self.config = model.config
        self.pp_rank = dist.get_rank(pp_group)
        self.last = len(stage_layers) - 1
        self.last_rank = owner[self.last]
        self.holds_last = self.last_rank == self.pp_rank
        self.dtype = next(model.parameters()).dtype
        """What the stages compute in (received hidden states are cast back to it)."""

    # -- what generate() and the log-prob code read of a model ------------------------------------
    def parameters(self, recurse: bool = True):  # noqa: D102
        return self.model.parameters(recurse)

    @property
    def layers(self) -> nn.ModuleDict:
        """This rank's layers (what routing replay records and replays: its routers)."""
        return self.model.layers

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> PipelinedInference:
        self.model.train(mode)
        return self

    def eval(self) -> PipelinedInference:
        return self.train(False)

    # -- one forward through the stages ------------------------------------------------------------
    def last_hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None, key_valid: torch.Tensor | None,
                    cache: KVCache | None = None) -> torch.Tensor | None:
        """The last stage's output (collapsed, before the final norm) on the rank holding it, None
        elsewhere. Stage outputs travel in fp32 (the residual stream's dtype under autocast)."""
        m = self.model
        batch, seq = tokens.shape
        refresh_compute_copies(m)
        offset = cache.length if cache is not None else 0
        hidden: torch.Tensor | None = None
        for stage, layers in enumerate(self.stage_layers):
            if self.owner[stage] != self.pp_rank:
                continue
            if stage == 0:
                hidden = m.embed(tokens)
            elif self.owner[stage - 1] != self.pp_rank:
                hidden = torch.empty(m.residual_shape(batch, seq), device=tokens.device)
                dist.recv(hidden, group=self.pp_group, group_src=self.owner[stage - 1])
                hidden = hidden.to(self.dtype)
            hidden = m.run_layers(hidden, layers, positions, key_valid, tokens, cache, offset)
            if stage < self.last and self.owner[stage + 1] != self.pp_rank:
                dist.send(hidden.float().contiguous(), group=self.pp_group, group_dst=self.owner[stage + 1])
        if cache is not None:
            cache.advance(seq)
        return m.collapse(hidden) if self.holds_last else None

    def _share(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's ``tensor`` on every pp rank (others pass a buffer of its shape and dtype)."""
        dist.broadcast(tensor, group=self.pp_group, group_src=self.last_rank)
        return tensor

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor, cache: KVCache | None,
                    pick: Pick, generator: torch.Generator | None,
                    output_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One decoding step: (next tokens [batch], their log-probs [batch], the logits [batch, vocab]
        when ``output_logits`` else None), the same on every pp rank. The last stage picks them with
        its ``generator``, whose state the other ranks then take over."""
        hidden = self.last_hidden(tokens, positions, key_valid, cache)
        batch, device = tokens.shape[0], tokens.device
        if self.holds_last:
            logits = self.model.head(hidden[:, -1]).float()
            if hasattr(logits, "full_tensor"):  # a tensor-parallel head's vocabulary shards
                logits = logits.full_tensor()
            next_tokens, logprob = pick(logits)
        else:
            logits = torch.empty((batch, self.config.vocab_size), device=device) if output_logits else None
            next_tokens = torch.empty(batch, dtype=torch.long, device=device)
            logprob = torch.empty(batch, device=device)
        self._share(next_tokens)
        self._share(logprob)
        if output_logits:
            self._share(logits)
        if generator is not None:
            state = self._share(generator.get_state().to(device)).cpu()
            if not self.holds_last:
                generator.set_state(state)
        return next_tokens, logprob, logits if output_logits else None

    def token_values(self, tokens: torch.Tensor, positions: torch.Tensor | None, key_valid: torch.Tensor | None,
                     of_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``of_logits(logits)`` [rows, seq] fp32 (e.g. the labels' log-probs), made on the last stage
        from its full-sequence logits and broadcast to every pp rank."""
        hidden = self.last_hidden(tokens, positions, key_valid)
        values = of_logits(self.model.head(hidden)).float() if self.holds_last else torch.empty(tokens.shape,
                                                                                              device=tokens.device)
        return self._share(values.contiguous())
