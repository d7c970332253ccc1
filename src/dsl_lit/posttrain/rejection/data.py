"""Rejection sampling (DeepSeek-R1's second SFT data and R1-Distill's): sample k completions per
prompt, keep those the rule rewards accept, and return them as SFT conversations.

Kept per prompt: at most ``keep_per_prompt`` accepted completions, distinct texts first. With
``verify=False`` every sample is kept (plain distillation). The records carry the reward and the
problem's reference so the written JSONL can be audited.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsl_lit.config.posttrain import RejectionConfig
from dsl_lit.inference.generation import generate
from dsl_lit.posttrain.chat.conversations import write_conversations
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer, prompt_and_reply
from dsl_lit.posttrain.rewards import WeightedRewards

log = logging.getLogger(__name__)


@dataclass
class RejectionStats:
    prompts: int = 0
    samples: int = 0
    accepted_samples: int = 0
    kept: int = 0
    prompts_with_a_kept_sample: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_samples / max(1, self.samples)

    def __add__(self, other: RejectionStats) -> RejectionStats:
        return RejectionStats(**{k: v + getattr(other, k) for k, v in asdict(self).items()})


def select(texts: Sequence[str], ended: Sequence[bool], problems: Sequence[dict[str, Any]],
           rewards: WeightedRewards, cfg: RejectionConfig, stats: RejectionStats) -> list[list[tuple[str, float]]]:
    """Per problem, the kept (text, reward) of its ``k = len(texts) / len(problems)`` consecutive
    samples: finished (ended with end-of-sentence) and, when verifying, reward >= ``min_reward``;
    distinct texts first, at most ``keep_per_prompt``. Updates ``stats``."""
    k = len(texts) // len(problems)
    total, _ = rewards(texts, [p for p in problems for _ in range(k)])
    kept: list[list[tuple[str, float]]] = []
    for i in range(len(problems)):
        group = range(i * k, (i + 1) * k)
        accepted = [j for j in group if ended[j] and (not cfg.verify or total[j].item() >= cfg.min_reward)]
        stats.accepted_samples += len(accepted)
        firsts = {texts[j]: j for j in reversed(accepted)}  # text -> its first accepted sample
        distinct = sorted(firsts.values())
        chosen = (distinct + [j for j in accepted if j not in distinct])[: cfg.keep_per_prompt]
        kept.append([(texts[j], round(total[j].item(), 4)) for j in chosen])
        stats.prompts_with_a_kept_sample += bool(chosen)
    return kept


def batch_generator(device: torch.device, seed: int, first_index: int) -> torch.Generator:
    """The sampling generator of the prompt batch starting at problem ``first_index``: seeded by
    the batch, not by the process, so any number of processes draws the same samples."""
    return torch.Generator(device).manual_seed(seed + 1_000_003 * first_index)


@dataclass
class RejectionSampler:
    """Everything sampling a batch needs besides the model: how a problem becomes a prompt, the
    tokenizer, the config and its rewards."""

    tokenizer: ChatTokenizer
    prompt_of: Callable[[dict[str, Any]], list[dict[str, str]]]
    cfg: RejectionConfig

    def __post_init__(self) -> None:
        self.rewards = WeightedRewards(self.cfg.rewards)

    def sample_batch(self, model: nn.Module, problems: Sequence[dict[str, Any]], stats: RejectionStats,
                     generator: torch.Generator) -> list[dict[str, Any]]:
        """Sample ``cfg.samples_per_prompt`` completions of each problem's prompt, keep the accepted
        ones (:func:`select`); records ``{"messages", "reward", "answer"}``. Updates ``stats``."""
        s, k, tokenizer = self.cfg.sampling, self.cfg.samples_per_prompt, self.tokenizer
        prompts = [tokenizer.encode_prompt(self.prompt_of(p)) for p in problems]
        out = generate(model, [p for p in prompts for _ in range(k)], s.max_new_tokens, temperature=s.temperature,
                       top_p=s.top_p, top_k=s.top_k, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                       generator=generator)
        texts = [tokenizer.decode(c) for c in out.completions]
        ended = [bool(c) and c[-1] == tokenizer.eos_id for c in out.completions]
        kept = select(texts, ended, problems, self.rewards, self.cfg, stats)
        records = [{"messages": prompt_and_reply(self.prompt_of(problem), text), "reward": reward,
                    "answer": problem.get("answer")}
                   for problem, texts_kept in zip(problems, kept) for text, reward in texts_kept]
        stats.prompts += len(problems)
        stats.samples += len(problems) * k
        stats.kept += len(records)
        return records


def rejection_sample(
    model: nn.Module,
    tokenizer: ChatTokenizer,
    problems: Sequence[dict[str, Any]],
    prompt_of: Callable[[dict[str, Any]], list[dict[str, str]]],
    cfg: RejectionConfig,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], RejectionStats]:
    """(records ``{"messages", "reward", "answer"}``, counts) for ``problems``, in this process,
    batch by batch of ``cfg.batch_prompts`` (what each process of a multi-process run does with
    its share of the batches: :class:`dsl_lit.posttrain.RejectionSamplingModule`)."""
    sampler = RejectionSampler(tokenizer, prompt_of, cfg)
    device = next(model.parameters()).device
    records: list[dict[str, Any]] = []
    stats = RejectionStats()
    for start in range(0, len(problems), cfg.batch_prompts):
        records += sampler.sample_batch(model, problems[start : start + cfg.batch_prompts], stats,
                                        batch_generator(device, seed, start))
    return records, stats


def summary_of(stats: RejectionStats, output: Path) -> dict[str, Any]:
    return {**asdict(stats), "acceptance_rate": stats.acceptance_rate, "output": str(output)}


def write_samples(output: Path, records: list[dict[str, Any]], stats: RejectionStats) -> dict[str, Any]:
    """Write the kept conversations (JSONL) and ``rejection_stats.json`` beside them; returns the summary."""
    write_conversations(output, records)
    summary = summary_of(stats, output)
    (output.parent / "rejection_stats.json").write_text(json.dumps(summary, indent=2))
    log.info("rejection sampling: %d of %d samples accepted (%.1f%%); %d kept from %d of %d prompts -> %s",
             stats.accepted_samples, stats.samples, 100 * stats.acceptance_rate, stats.kept,
             stats.prompts_with_a_kept_sample, stats.prompts, output)
    return summary
