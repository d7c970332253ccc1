"""Batched autoregressive generation with a KV cache, for every model family.

Prompts of different lengths are left-padded into one block: ``key_valid`` marks the real tokens
and each sequence's positions count only its own tokens (``cumsum(valid) - 1``), so a prompt's
result does not depend on what it is batched with. The first forward runs the whole prompt block
through the model and fills the cache; every later step feeds one token per sequence. Greedy
decoding at ``temperature=0``; otherwise the logits are divided by the temperature, filtered by
top-k and then top-p (nucleus), and sampled with ``torch.multinomial`` (the same order as
Hugging Face's ``generate``). A sequence that has emitted an end-of-sequence token keeps emitting
the pad token until every sequence is done or ``max_new_tokens`` is reached.

``use_cache=False`` recomputes the whole sequence at every step with the same positions and mask:
slow, but the reference the cached path is tested against.

RL recipes (GRPO, rejection sampling) sample several completions per prompt by repeating the
prompt in the list; :attr:`GenerationOutput.logprobs` holds the log-probability of every sampled
token under the model (``log_softmax`` of the raw fp32 logits, before temperature and filtering)
and :attr:`GenerationOutput.attention_mask` with :func:`positions_from_mask` lets them recompute
the same log-probs with gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsl_lit.inference.speculative import DraftStats, decode_with_mtp_drafts
from dsl_lit.models.common.kv_cache import KVCache


@dataclass
class GenerationOutput:
    """What :func:`generate` returns; all tensors on the model's device, none of them inference tensors.

    ``T`` is the number of steps actually run: ``max_new_tokens``, or fewer when every sequence
    emitted an end-of-sequence token earlier.
    """

    sequences: torch.Tensor
    """[batch, prompt_length + T] left-padded prompts followed by the generated tokens (pad after eos)."""
    attention_mask: torch.Tensor
    """[batch, prompt_length + T] bool: real prompt tokens and completion tokens up to the first eos."""
    completion_mask: torch.Tensor
    """[batch, T] bool: generated tokens up to and including the first eos."""
    completions: list[list[int]]
    """Generated ids per prompt, cut after the first eos (eos included)."""
    logprobs: torch.Tensor
    """[batch, T] fp32 log-probability of each generated token under the model's logits divided by
    ``logprob_temperature`` (1: the raw logits; no top-k/top-p filtering); 0 where ``completion_mask``
    is False."""
    prompt_length: int
    """Width of the left-padded prompt block (the longest prompt)."""
    logits: torch.Tensor | None = None
    """[batch, T, vocab] fp32 raw logits of every step when ``output_logits=True``."""
    draft_stats: DraftStats | None = None
    """MTP drafts made and accepted, and main-model forwards, with ``mtp_speculative=True``."""

    @property
    def completion_ids(self) -> torch.Tensor:
        """[batch, T] the generated part of :attr:`sequences`."""
        return self.sequences[:, self.prompt_length :]


def positions_from_mask(valid: torch.Tensor) -> torch.Tensor:
    """Per-token positions of a left-padded batch: ``cumsum(valid) - 1``, padding at 0."""
    return (valid.long().cumsum(dim=-1) - 1).clamp(min=0)


# -- sampling helpers ------------------------------------------------------------------------------


def top_k_mask(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Bool mask (same shape) keeping exactly the ``top_k`` highest logits along the last dim."""
    if top_k <= 0:
        raise ValueError(f"top_k={top_k} must be a positive integer")
    if top_k >= logits.shape[-1]:
        return torch.ones_like(logits, dtype=torch.bool)
    indices = logits.topk(top_k, dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, indices, True)


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask keeping the smallest set of most probable tokens whose total probability is at
    least ``top_p`` (nucleus sampling); the most probable token is always kept.

    A token is dropped when the tokens more probable than it already reach ``top_p``:
    ``[0.5, 0.3, 0.15, 0.05]`` with ``top_p=0.8`` keeps the first two.
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Probability mass strictly before each token (a shifted cumsum, not cumsum - p, so that the
    # boundary case sum == top_p is exact).
    before = F.pad(sorted_probs.cumsum(dim=-1)[..., :-1], (1, 0))
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True
    return torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float = 1.0) -> torch.Tensor:
    """Set the logits outside top-k, then outside the top-p nucleus (of the renormalised top-k
    distribution), to -inf."""
    if top_k is not None:
        logits = logits.masked_fill(~top_k_mask(logits, top_k), float("-inf"))
    if top_p < 1.0:
        logits = logits.masked_fill(~top_p_mask(logits.softmax(dim=-1), top_p), float("-inf"))
    return logits


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next tokens [batch] from logits [batch, vocab]: argmax at ``temperature=0``, otherwise a
    sample of ``softmax(filter_logits(logits / temperature))``."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# -- generation ------------------------------------------------------------------------------------


def _check_arguments(max_new_tokens: int, temperature: float, top_p: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k={top_k} must be a positive integer or None")


def _left_pad(
    prompts: Sequence[Sequence[int] | torch.Tensor], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> (tokens [batch, max_len] left-padded, valid [batch, max_len] bool)."""
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    for i, row in enumerate(rows):
        if row.numel() == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
    width = max(row.numel() for row in rows)
    tokens = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens[i, width - row.numel() :] = row
        valid[i, width - row.numel() :] = True
    return tokens.to(device), valid.to(device)


def _last_logits(
    model: nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    key_valid: torch.Tensor,
    cache: KVCache | None,
) -> torch.Tensor:
    """fp32 logits [batch, vocab] of the last position (the head runs on that position only)."""
    if hasattr(model, "hidden_states") and hasattr(model, "head"):
        hidden = model.hidden_states(tokens, positions, key_valid, cache)
        logits = model.head(hidden[:, -1])
    else:
        logits = model(tokens, positions, key_valid, cache)[:, -1]
    if hasattr(logits, "full_tensor"):  # a tensor-parallel head's vocabulary shards (a DTensor)
        logits = logits.full_tensor()
    return logits.float()


@torch.compiler.set_stance("force_eager")  # compiled blocks (trainer.compile) run eagerly: shapes change every token
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | Sequence[torch.Tensor],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    output_logits: bool = False,
    mtp_speculative: bool = False,
    stop: Callable[[torch.Tensor], torch.Tensor] | None = None,
    all_finished: Callable[[bool], bool] | None = None,
    logprob_temperature: float = 1.0,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after each prompt, in one left-padded batch.

    ``temperature=0`` is greedy; otherwise tokens are sampled after temperature, ``top_k`` and
    ``top_p`` filtering, from ``generator`` (which must live on the model's device). Generation
    stops early once every sequence has emitted one of ``eos_token_id`` or been stopped by ``stop``:
    called after every step with the completions so far of the sequences still running
    ([running, steps] token ids), it returns which of them are done (True), e.g. because their
    text now holds a stop string (lm-eval's ``until``). ``use_cache=False``
    recomputes the whole sequence every step (the reference for tests). ``mtp_speculative=True``
    (greedy only) drafts each next-but-one token with the model's MTP module and verifies it in the
    main model's next forward (:mod:`dsl_lit.inference.speculative`): the same tokens, fewer
    forwards; :attr:`GenerationOutput.draft_stats` counts them. ``logprob_temperature``: the
    temperature :attr:`GenerationOutput.logprobs` are taken at (RL passes its sampling temperature,
    so the sampler's log-probs compare with the training forward's). Runs in eval mode under
    ``torch.inference_mode`` and restores the model's training mode afterwards.

    ``model`` may be the shards of a model whose forward is a collective (tensor or expert
    parallel): the ranks holding them must then run the same number of forwards, so generation
    stops early only when ``all_finished(done_here)`` (called by every rank after every step, e.g.
    an all-reduce) says that every rank is done. A rank that finished first keeps decoding pads,
    so its completions are the ones a single process would produce. A model with ``decode_step``
    (pipeline stages, :class:`dsl_lit.parallel.pipeline_inference.PipelinedInference`) runs each
    step through its stages: the last stage picks the tokens with ``generator`` and every rank
    receives them and the generator's state.
    """
    _check_arguments(max_new_tokens, temperature, top_p, top_k)
    if mtp_speculative and (temperature != 0.0 or not use_cache):
        raise ValueError("mtp_speculative=True is greedy decoding with the KV cache: temperature=0, use_cache=True")
    if hasattr(model, "decode_step") and temperature != 0.0 and generator is None:
        raise ValueError("sampling through pipeline stages needs generator=torch.Generator(...): the last stage "
                         "draws and the others take over its generator's state")
    if mtp_speculative and (all_finished is not None or hasattr(model, "decode_step")):
        raise ValueError("mtp_speculative=True decodes on one process: all_finished must be None, no pipeline stages")
    if len(prompts) == 0:
        raise ValueError("generate() needs at least one prompt")
    device = next(model.parameters()).device
    prompt_tokens, prompt_valid = _left_pad(prompts, pad_token_id, device)
    batch, prompt_length = prompt_tokens.shape
    total = prompt_length + max_new_tokens
    max_seq_len = model.config.max_seq_len
    if total > max_seq_len:
        raise ValueError(
            f"longest prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds the model's max_seq_len={max_seq_len}; shorten the prompts or max_new_tokens"
        )
    if eos_token_id is None:
        eos_ids = None
    else:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        eos_ids = torch.tensor(ids, dtype=torch.long, device=device)

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            sequences, completion_mask, logprobs, logits, stats = _decode(
                model, prompt_tokens, prompt_valid, max_new_tokens, temperature, top_k, top_p,
                eos_ids, pad_token_id, generator, use_cache, output_logits, mtp_speculative, stop, all_finished,
                logprob_temperature,
            )
    finally:
        model.train(was_training)

    # Clone outside inference mode: inference tensors cannot be saved for backward, and RL recipes
    # feed these straight into a training forward.
    sequences, completion_mask, logprobs = sequences.clone(), completion_mask.clone(), logprobs.clone()
    logits = logits.clone() if logits is not None else None
    completions = [
        row[:n].tolist() for row, n in zip(sequences[:, prompt_length:].cpu(), completion_mask.sum(dim=1).tolist())
    ]
    return GenerationOutput(
        sequences=sequences,
        attention_mask=torch.cat([prompt_valid.clone(), completion_mask], dim=1),
        completion_mask=completion_mask,
        completions=completions,
        logprobs=logprobs,
        prompt_length=prompt_length,
        logits=logits,
        draft_stats=stats,
    )


def _decode(
    model: nn.Module,
    prompt_tokens: torch.Tensor,
    prompt_valid: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float,
    eos_ids: torch.Tensor | None,
    pad_token_id: int,
    generator: torch.Generator | None,
    use_cache: bool,
    output_logits: bool,
    mtp_speculative: bool = False,
    stop: Callable[[torch.Tensor], torch.Tensor] | None = None,
    all_finished: Callable[[bool], bool] | None = None,
    logprob_temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, DraftStats | None]:
    """The decoding loop; returns (sequences, completion_mask, logprobs, logits or None, draft stats)."""
    batch, prompt_length = prompt_tokens.shape
    device = prompt_tokens.device
    total = prompt_length + max_new_tokens
    # Every buffer is allocated once for the whole run; each step reads a prefix of them.
    tokens = torch.full((batch, total), pad_token_id, dtype=torch.long, device=device)
    tokens[:, :prompt_length] = prompt_tokens
    # Generated tokens (pads after eos included) are valid keys while decoding: a finished
    # sequence's later steps are discarded anyway, and this keeps every row's work identical.
    valid = torch.ones((batch, total), dtype=torch.bool, device=device)
    valid[:, :prompt_length] = prompt_valid
    positions = positions_from_mask(valid)
    completion_mask = torch.zeros((batch, max_new_tokens), dtype=torch.bool, device=device)
    logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    all_logits: list[torch.Tensor] = []
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    done = 0

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next tokens [batch] from ``logits`` [batch, vocab] and their log-probs under them."""
        next_tokens = sample_next_token(logits, temperature, top_k, top_p, generator)
        scaled = logits if logprob_temperature == 1.0 else logits.float() / logprob_temperature
        return next_tokens, scaled.log_softmax(dim=-1).gather(-1, next_tokens[:, None]).squeeze(-1)

    def record(step: int, next_tokens: torch.Tensor, logprob: torch.Tensor, logits: torch.Tensor | None) -> bool:
        """Record step ``step``'s tokens; True once every row is done."""
        nonlocal done
        if output_logits:
            all_logits.append(logits)
        active = ~finished
        tokens[:, prompt_length + step] = torch.where(active, next_tokens, pad_token_id)
        logprobs[:, step] = torch.where(active, logprob, 0.0)
        completion_mask[:, step] = active
        done = step + 1
        if eos_ids is not None:
            finished.logical_or_(active & torch.isin(next_tokens, eos_ids))
        if stop is not None:
            running = (~finished).nonzero().squeeze(-1)
            if running.numel():
                finished[running] = stop(tokens[running, prompt_length : prompt_length + step + 1]).to(device)
        return (eos_ids is not None or stop is not None) and bool(finished.all())

    def emit(step: int, logits: torch.Tensor) -> bool:
        """Record step ``step``'s token from ``logits`` [batch, vocab]; True once every row is done."""
        return record(step, *pick(logits), logits)

    if mtp_speculative:
        stats = decode_with_mtp_drafts(model, tokens, valid, positions, prompt_length, max_new_tokens, emit)
    else:
        stats = None
        cache = KVCache(batch, total) if use_cache else None
        for step in range(max_new_tokens):
            length = prompt_length + step  # tokens known so far
            start = 0 if cache is None or step == 0 else length - 1  # the cache holds the rest
            step_inputs = (tokens[:, start:length], positions[:, start:length], valid[:, :length], cache)
            if hasattr(model, "decode_step"):  # pipeline stages: the last one picks, every rank gets the tokens
                done_here = record(step, *model.decode_step(*step_inputs, pick, generator, output_logits))
            else:
                done_here = emit(step, _last_logits(model, *step_inputs))
            if all_finished(done_here) if all_finished is not None else done_here:
                break
    steps = done

    logits_out = None
    if output_logits:
        vocab = model.config.vocab_size
        logits_out = torch.stack(all_logits, dim=1) if all_logits else torch.zeros((batch, 0, vocab), device=device)
    return tokens[:, : prompt_length + steps], completion_mask[:, :steps], logprobs[:, :steps], logits_out, stats
