"""Every benchmark's headline ratios in one table: ``python -m benchmarks [--only NAME] [--full]``.

Each benchmark runs in its own process (its own imports, threads and memory peak), at a quick size
unless ``--full``; the table names the CPU and whether it has native bf16, because ratios against
bf16 or between dtypes depend on it. A benchmark that fails or times out is a row saying so.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.headline import parse
from dsl_lit.utils.machine import cpu_description

ROOT = Path(__file__).resolve().parents[1]
# module, arguments at the quick size (--full drops them: each script's own defaults)
BENCHMARKS: list[tuple[str, list[str]]] = [
    ("deepseek_v3_vs_transformers", ["--repeats", "5"]),
    ("deepseek_v3_vs_transformers", ["--repeats", "5", "--dtype", "bf16"]),
    ("deepseek_v3_vs_transformers", ["--repeats", "3", "--family", "deepseek_llm", "--layers", "4"]),
    ("mtp_speculative", ["--steps", "150", "--repeats", "3"]),
    ("adamw_kernels", ["--repeats", "5"]),
    ("generation_speed", ["--new", "64", "--repeats", "2"]),
    ("sharded_sampling_memory", ["--layers", "4", "--vocab", "16000"]),
    ("cross_entropy_memory", ["--tokens", "2048"]),
    ("expert_weight_copies", ["--repeats", "2"]),
    ("context_parallel_overhead", ["--seq", "512", "--repeats", "3"]),
    ("data_pipeline_speed", ["--repeats", "1", "--crawl-docs", "1000"]),
    ("template_bounds", []),
    ("precision_auto", []),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the benchmarks whose module name contains this")
    parser.add_argument("--full", action="store_true", help="each benchmark's own default sizes")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per benchmark")
    args = parser.parse_args()
    rows: list[tuple[str, str, str, str, str]] = []
    for module, quick in BENCHMARKS:
        if args.only and args.only not in module:
            continue
        command = [sys.executable, "-m", f"benchmarks.{module}", *([] if args.full else quick)]
        label = " ".join([module, *([] if args.full else quick)])
        print(f"[benchmarks] {label}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rows.append((label, "timed out", "", "", f"{args.timeout:.0f}"))
            continue
        seconds = f"{time.perf_counter() - start:.0f}"
        found = [parsed for line in result.stdout.splitlines() if (parsed := parse(line))]
        if result.returncode != 0 or not found:
            rows.append((label, f"failed (exit {result.returncode})", "", result.stderr.strip()[-200:], seconds))
        rows.extend((label, what, f"{value}{unit}", goal, seconds) for what, value, unit, goal in found)
    print(f"\n{cpu_description()}\n")
    print("| benchmark | what | measured | goal | s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
