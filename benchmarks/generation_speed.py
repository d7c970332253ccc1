"""Generation tokens/s with and without the KV cache, in one run (the ratio is the result).

    python -m benchmarks.generation_speed [--model deepseek_llm_tiny] [--batch 16] [--prompt 32] [--new 64]

Both paths generate the same greedy tokens (checked); without the cache every step recomputes the
whole sequence, so its cost grows with the length and the ratio grows with ``--new``.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.headline import headline
from dsl_lit.inference.generation import generate
from dsl_lit.models import ModelConfig, build_model


def tokens_per_s(model: torch.nn.Module, prompts: list[list[int]], new: int, use_cache: bool, repeats: int) -> tuple[float, torch.Tensor]:
    generate(model, prompts, 4, use_cache=use_cache)  # warm-up
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(model, prompts, new, use_cache=use_cache)
        best = min(best, time.perf_counter() - start)
    return len(prompts) * new / best, out.sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek_llm_tiny")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    overrides = {"n_layers": args.layers} if args.layers else {}
    cfg = ModelConfig.from_name(args.model, **overrides)
    model = build_model(cfg).eval()
    prompts = torch.randint(16, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    print(f"{args.model} ({model.num_params() / 1e6:.1f}M params), batch {args.batch}, prompt {args.prompt} tokens, "
          f"greedy, {torch.get_num_threads()} threads")
    print(f"{'new tokens':>10} | {'KV cache tok/s':>14} | {'no cache tok/s':>14} | {'speed-up':>8}")
    for new in args.new:
        cached, seq_a = tokens_per_s(model, prompts, new, True, args.repeats)
        plain, seq_b = tokens_per_s(model, prompts, new, False, args.repeats)
        same = "" if torch.equal(seq_a, seq_b) else "  (outputs differ!)"
        print(f"{new:>10} | {cached:>14.0f} | {plain:>14.0f} | {cached / plain:>7.1f}x{same}")
        headline(f"KV cache vs none, {new} new tokens", cached / plain, "x", "> 1x, same tokens" if not same else "DIFFERENT")


if __name__ == "__main__":
    main()
