"""MTP speculative decoding vs plain greedy decoding (both with the KV cache), in one run.

    python -m benchmarks.mtp_speculative [--steps 150] [--new 64] [--repeats 5]

The tiny DeepSeek-V3 (one MTP module) is first trained for ``--steps`` on a deterministic cycle so
that its MTP head has something to predict (a random MTP head is almost never right); the V3
report measures 85-90% acceptance of the second token on a real model. Prints the acceptance
rate, main-model forwards per token and the tokens/s ratio, at batch 1 (where a draft is accepted
whenever it is right) and batch 8 (accepted only when every row's draft is right).
"""

from __future__ import annotations

import argparse
import platform

import torch

from benchmarks.headline import headline
from benchmarks.timing import interleaved_medians
from dsl_lit.inference.generation import generate
from tests.unit.inference.test_speculative import _trained_on_a_cycle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    model = _trained_on_a_cycle(args.steps).eval()
    print(f"{'batch':>5} {'acceptance':>10} {'forwards/token':>14} {'plain tok/s':>11} {'mtp tok/s':>9} {'speed-up':>8}")
    for batch in (1, 8):
        prompts = [[(7 * i) % 61, (7 * i + 3) % 61] for i in range(batch)]
        out = generate(model, prompts, args.new, mtp_speculative=True)
        assert torch.equal(out.sequences, generate(model, prompts, args.new).sequences)
        times = interleaved_medians({
            "plain": lambda p=prompts: generate(model, p, args.new),
            "mtp": lambda p=prompts: generate(model, p, args.new, mtp_speculative=True),
        }, repeats=args.repeats)
        stats = out.draft_stats
        tokens = batch * args.new
        print(f"{batch:>5} {stats.acceptance:>10.1%} {(stats.forwards + 1) / args.new:>14.2f} "
              f"{tokens / times['plain']:>11.0f} {tokens / times['mtp']:>9.0f} {times['plain'] / times['mtp']:>7.2f}x")
        headline(f"MTP speculative decoding, batch {batch}: acceptance", 100 * stats.acceptance, "%",
                 "85-90% (V3 report)" if batch == 1 else "")
        headline(f"MTP speculative decoding, batch {batch}: speed-up", times["plain"] / times["mtp"], "x", "> 1x")


if __name__ == "__main__":
    main()
