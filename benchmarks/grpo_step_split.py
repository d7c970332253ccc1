"""Where a GRPO step's time goes: generation vs the rest (rewards, reference log-probs, forward,
backward and optimizer step), read from a GRPO run's metrics.csv (``perf/generation_s``,
``perf/training_s``, logged every step by ``GRPOModule``).

    python -m benchmarks.grpo_step_split outputs/grpo/<run>      # a run of recipes/grpo.py
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    args = parser.parse_args()
    with (args.run_dir / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/generation_s") and r.get("perf/training_s")]
    rows = rows[args.skip :]
    if not rows:
        raise SystemExit(f"{args.run_dir}/metrics.csv has no GRPO timing rows (perf/generation_s)")
    gen = [float(r["perf/generation_s"]) for r in rows]
    train = [float(r["perf/training_s"]) for r in rows]
    length = [float(r["completion/length"]) for r in rows]
    g, t = sum(gen) / len(gen), sum(train) / len(train)
    print(f"GRPO steps {rows[0]['step']}..{rows[-1]['step']} of {args.run_dir} ({len(rows)} steps)")
    print(f"{'phase':>28} | {'s / step':>8} | {'share':>6}")
    print(f"{'generation (KV cache)':>28} | {g:>8.2f} | {g / (g + t):>6.1%}")
    print(f"{'ref logps + fwd/bwd + optim':>28} | {t:>8.2f} | {t / (g + t):>6.1%}")
    print(f"mean completion length {sum(length) / len(length):.1f} tokens")


if __name__ == "__main__":
    main()
