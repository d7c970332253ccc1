"""How the pipeline's time and memory grow with the corpus: per stage, at 10K, 100K and 1M documents.

    python -m benchmarks.pipeline_growth [--sizes 10000 100000 1000000] [--procs 1 2]
        [--rows-per-shard 5000] [--work /tmp/pipeline_growth] [--resume]

The corpus (benchmarks.crawl_corpus: ~300-word documents from the bundled corpus's vocabulary, 5%
exact and 10% near duplicates planted) is written once per size as gzipped JSON-lines files of up
to 100K documents, which ``input.rows_per_shard`` cuts into shards. Each (size, processes) runs in
a fresh process, so no run inherits another's heap. Per stage it prints documents/s (documents
into the stage over the wall-clock seconds of its steps) and the peak resident memory of the
largest single process (the maximum over the stage's units of the per-unit peak each marker
records: data_pipeline.peak_memory), then the growth exponents: the log-log slope of seconds
and of peak memory against documents (1 = linear, 0 = flat). ``plan`` is the planning before the
first step: the input's content fingerprint and the line scan that cuts the gzip files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

STAGES = ["normalize", "exact_dedup", "near_dedup", "quality_filter", "language_filter"]
ROOT = Path(__file__).resolve().parents[1]


def measure(corpus: Path, output_dir: Path, num_proc: int, rows_per_shard: int) -> dict[str, Any]:
    """One pipeline run, timed step by step; per stage: documents in, wall seconds, peak MiB."""
    from data_pipeline.config import load_config
    from data_pipeline.executors.local import LocalExecutor
    from data_pipeline.io.shards import read_marker
    from data_pipeline.runner import plan, run

    class TimedExecutor(LocalExecutor):
        def __init__(self, num_proc: int) -> None:
            super().__init__(num_proc)
            self.seconds: dict[str, float] = {}  # by step

        def run(self, fn, step, ctx, units) -> None:  # noqa: ANN001 (the Executor protocol's types)
            start = time.perf_counter()
            super().run(fn, step, ctx, units)
            self.seconds[step.name] = time.perf_counter() - start

    quality = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/data_pipeline/quality_filter/default.yaml"))
    cfg = load_config(
        {
            "input": {"path": str(corpus), "rows_per_shard": rows_per_shard},
            "output_dir": str(output_dir),
            "stages": STAGES,
            "num_proc": num_proc,
            "quality_filter": quality,
        }
    )
    executor = TimedExecutor(num_proc)
    start = time.perf_counter()
    try:
        stats = run(cfg, executor)
        total = time.perf_counter() - start
    finally:
        executor.close()
    steps: dict[str, dict[str, Any]] = {}
    for p in plan(cfg):
        peak = max(read_marker(p.context.step_dir, u)["peak_rss_mb"] for u in range(p.num_units))
        steps[p.step.name] = {
            "stage": p.step.stage,
            "seconds": executor.seconds[p.step.name],
            "peak_mb": peak,
        }
    stages: dict[str, dict[str, Any]] = {
        "plan": {
            "documents": stats["input"]["documents"],
            "seconds": total - sum(executor.seconds.values()),
            "peak_mb": 0.0,
            "removed": 0,
        }
    }
    for name, s in stats["stages"].items():
        mine = [v for v in steps.values() if v["stage"] == name]
        stages[name] = {
            "documents": s.get("docs_in", stats["output"]["documents"]),
            "seconds": sum(v["seconds"] for v in mine),
            "peak_mb": max(v["peak_mb"] for v in mine),
            "removed": sum(s.get("removed", {}).values()),
        }
    return {"seconds": total, "shards": stats["stages"]["ingest"]["units"], "stages": stages, "steps": steps}


def slope(x: list[float], y: list[float]) -> float:
    return float(np.polyfit(np.log(x), np.log(y), 1)[0]) if len(x) > 1 else float("nan")


def report(results: dict[tuple[int, int], dict[str, Any]], sizes: list[int], procs: list[int]) -> None:
    stages = list(next(iter(results.values()))["stages"])
    for p in procs:
        print(f"\nnum_proc={p}: documents/s per stage (peak MiB of one process)\n")
        print(
            "| stage | " + " | ".join(f"{n:,} docs" for n in sizes) + " | time exponent | memory exponent |"
        )
        print("|---|" + "---:|" * (len(sizes) + 2))
        for stage in stages:
            rows = [results[(n, p)]["stages"][stage] for n in sizes]
            cells = [
                f"{r['documents'] / r['seconds']:,.0f}" + (f" ({r['peak_mb']:,.0f})" if r["peak_mb"] else "")
                for r in rows
            ]
            t = slope([r["documents"] for r in rows], [r["seconds"] for r in rows])
            m = (
                slope([r["documents"] for r in rows], [r["peak_mb"] for r in rows])
                if rows[0]["peak_mb"]
                else float("nan")
            )
            print(f"| {stage} | " + " | ".join(cells) + f" | {t:.2f} | {m:.2f} |")
        walls = [results[(n, p)]["seconds"] for n in sizes]
        cells = [f"{n / w:,.0f} ({w:,.0f} s)" for n, w in zip(sizes, walls)]
        print("| **whole run** | " + " | ".join(cells) + f" | {slope(sizes, walls):.2f} | |")
    dedup = [k for k, v in results[(sizes[0], procs[0])]["steps"].items() if v["stage"].endswith("dedup")]
    print(f"\ndedup steps, num_proc={procs[-1]}: seconds (peak MiB of one process)\n")
    print("| step | " + " | ".join(f"{n:,} docs" for n in sizes) + " | memory exponent |")
    print("|---|" + "---:|" * (len(sizes) + 1))
    for step in dedup:
        rows = [results[(n, procs[-1])]["steps"][step] for n in sizes]
        m = slope(sizes, [r["peak_mb"] for r in rows])
        print(
            f"| {step} | "
            + " | ".join(f"{r['seconds']:,.1f} ({r['peak_mb']:,.0f})" for r in rows)
            + f" | {m:.2f} |"
        )
    n = sizes[-1]
    removed = {s: results[(n, procs[0])]["stages"][s]["removed"] for s in stages if s != "plan"}
    print(f"\nremoved at {n:,} documents: {removed}; shards: {results[(n, procs[0])]['shards']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows-per-shard", type=int, default=5000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/pipeline_growth"))
    parser.add_argument("--resume", action="store_true", help="reuse the results of runs finished before")
    parser.add_argument(
        "--measure", nargs=3, metavar=("CORPUS", "OUTPUT_DIR", "NUM_PROC"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.measure:  # the child: one run, its result as the last line
        corpus, out, num_proc = args.measure
        print(json.dumps(measure(Path(corpus), Path(out), int(num_proc), args.rows_per_shard)))
        return
    from benchmarks.crawl_corpus import write_corpus

    results: dict[tuple[int, int], dict[str, Any]] = {}
    for n in args.sizes:
        corpus, planted_file = args.work / f"corpus-{n}", args.work / f"corpus-{n}.planted.json"
        if not planted_file.is_file():
            start = time.perf_counter()
            planted = write_corpus(corpus, n)
            planted_file.write_text(json.dumps(planted))
            print(f"wrote {n:,} documents in {time.perf_counter() - start:.0f} s: {planted}", flush=True)
        for p in args.procs:
            saved = args.work / f"result-{n}-{p}.json"
            if args.resume and saved.is_file():  # a run an interrupted benchmark finished
                results[(n, p)] = json.loads(saved.read_text())
                continue
            out = args.work / f"run-{n}-{p}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.pipeline_growth",
                "--rows-per-shard",
                str(args.rows_per_shard),
                "--measure",
                str(corpus),
                str(out),
                str(p),
            ]
            child = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if child.returncode:
                sys.exit(f"run {n} x {p} failed:\n{child.stderr[-3000:]}")
            results[(n, p)] = json.loads(child.stdout.strip().splitlines()[-1])
            saved.write_text(json.dumps(results[(n, p)]))
            print(f"{n:,} documents, num_proc={p}: {results[(n, p)]['seconds']:.0f} s", flush=True)
    report(results, args.sizes, args.procs)


if __name__ == "__main__":
    main()
