"""Passkey retrieval accuracy of a model at given context lengths and key depths.

A prompt of about ``length`` tokens hides a key (``KEY_LENGTH`` words) at ``depth`` (0: the start, 1: just
before the question); it is retrieved when greedy decoding writes the whole key. One forward
pass decides it: with the answer appended, greedy decoding writes the answer exactly when the
argmax at each answer position is the next answer token (teacher forcing is greedy decoding
along the right path), so a prompt costs one forward, not one per answer token.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from dsl_lit.models import Transformer, build_model
from dsl_lit.tasks.passkey import filler, prompt_text, random_key


@dataclass
class PasskeyPrompt:
    tokens: list[int]
    """Prompt then answer (the key's tokens)."""
    answer_len: int
    key_position: int
    """Token index where the key sentence starts (its distance to the question is what is tested)."""


def passkey_prompt(tokenizer: Tokenizer, rng: random.Random, length: int, depth: float) -> PasskeyPrompt:
    """The longest prompt of at most ``length`` tokens (answer included) with the key sentence
    after ``depth`` of its filler."""
    key = random_key(rng)
    answer = tokenizer.encode(" " + key, add_special_tokens=False).ids
    seed = rng.random()

    def encoded(sentences: int) -> tuple[list[int], int]:
        n_before = round(depth * sentences)  # the same draws for every count: longer with each one
        text = prompt_text(random.Random(seed), n_before, sentences - n_before, key)
        return tokenizer.encode(text, add_special_tokens=False).ids, n_before

    def fits(sentences: int) -> bool:
        return len(encoded(sentences)[0]) + len(answer) <= length

    if not fits(1):
        raise ValueError(f"length={length} tokens cannot hold a passkey prompt")
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:  # the most filler sentences that fit: low fits, high does not
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    ids, n_before = encoded(low)
    before = filler(random.Random(seed), n_before).lstrip()
    position = len(tokenizer.encode(before, add_special_tokens=False).ids) if n_before else 0
    return PasskeyPrompt(ids + answer, len(answer), position)


@torch.no_grad()
def retrieved(model: nn.Module, prompt: PasskeyPrompt, device: torch.device | str = "cpu") -> bool:
    tokens = torch.tensor([prompt.tokens], device=device)
    logits = model(tokens[:, :-1])
    guess = logits[0, -prompt.answer_len:].argmax(-1)
    return bool(torch.equal(guess, tokens[0, -prompt.answer_len:]))


def passkey_outcomes(
    model: nn.Module, tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float],
    per_depth: int, seed: int = 0, device: torch.device | str = "cpu",
) -> dict[int, dict[float, list[bool]]]:
    """``{length: {depth: [retrieved, ...]}}``, prompt by prompt; the same prompts for the same seed
    (so two models' outcomes pair up, prompt by prompt)."""
    model.eval()
    table: dict[int, dict[float, list[bool]]] = {}
    for length in lengths:
        table[length] = {}
        for depth in depths:
            rng = random.Random(f"{seed}/{length}/{depth}")
            table[length][depth] = [retrieved(model, passkey_prompt(tokenizer, rng, length, depth), device)
                                    for _ in range(per_depth)]
    return table


def passkey_accuracy(
    model: nn.Module, tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float],
    per_depth: int, seed: int = 0, device: torch.device | str = "cpu",
) -> dict[int, dict[float, float]]:
    """``{length: {depth: share of prompts retrieved}}`` of :func:`passkey_outcomes`."""
    return shares(passkey_outcomes(model, tokenizer, lengths, depths, per_depth, seed, device))


def shares(outcomes: dict[int, dict[float, list[bool]]]) -> dict[int, dict[float, float]]:
    """The share retrieved per (length, depth) of prompt-by-prompt outcomes."""
    return {n: {d: sum(hits) / len(hits) for d, hits in row.items()} for n, row in outcomes.items()}


def with_context(model: Transformer, max_seq_len: int, rope_scaling: dict[str, Any] | None = None) -> Transformer:
    """The same weights with RoPE tables up to ``max_seq_len`` (plain extrapolation past the
    trained length), under ``rope_scaling`` when given (YaRN applied without training: the tables
    and MLA's softmax scale are derived from the config, not stored)."""
    scaling = model.config.rope_scaling if rope_scaling is None else dict(rope_scaling)
    cfg = dataclasses.replace(model.config, rope_scaling=scaling, max_seq_len=max_seq_len)
    if cfg == model.config:
        return model
    scaled = build_model(cfg)
    scaled.load_state_dict(model.state_dict())
    return scaled.eval()


def markdown_table(table: dict[int, dict[float, float]]) -> str:
    """Rows: lengths; columns: depths, then the mean."""
    depths = list(next(iter(table.values())))
    lines = ["| tokens | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean |",
             "|---:|" + "---:|" * (len(depths) + 1)]
    for length, row in table.items():
        cells = [f"{100 * row[d]:.0f}%" for d in depths]
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {100 * sum(row.values()) / len(row):.0f}% |")
    return "\n".join(lines)
