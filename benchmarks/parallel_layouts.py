"""Step time of each parallel layout on this machine, through the real recipe, as one table.

Every layout trains the same model on the same global batch (so the work per step is equal) for
``--steps`` steps in fresh processes; the table shows the median step time after the first two
steps and its ratio to one process. On a 2-core CPU more processes only add communication; the
table is for spotting regressions and for comparing layouts on real hardware.

    .venv/bin/python -m benchmarks.parallel_layouts [--steps 8] [--model deepseek_v3_tiny]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "single": ["trainer.devices=1"],
    "dp2": ["trainer.devices=2"],
    "dp2 zero1": ["trainer.devices=2", "parallel=zero1"],
    "tp2": ["trainer.devices=2", "parallel.tp=2"],
    "dp2 x tp2": ["trainer.devices=4", "parallel.tp=2"],
    "pp2 1F1B": ["trainer.devices=2", "parallel=pp_1f1b"],
    "pp2 DualPipeV": ["trainer.devices=2", "parallel=pp_dualpipev"],
    "dp2 x ep2": ["trainer.devices=2", "parallel=ep"],
    "cp2": ["trainer.devices=2", "parallel=cp2"],
    "tp2 x pp2": ["trainer.devices=4", "parallel.tp=2", "parallel=pp_1f1b"],
}


def step_times(run_dir: Path) -> list[float]:
    with (run_dir / "metrics.csv").open() as f:
        return [float(r["perf/step_time_s"]) for r in csv.DictReader(f) if r.get("perf/step_time_s")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="deepseek_v3_tiny")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    common = [f"model={args.model}", f"trainer.max_steps={args.steps}", "trainer.log_every_n_steps=1",
              "trainer.accelerator=cpu", "trainer.progress_bar=false", "logger=csv", "checkpoint.every_n_steps=0", "checkpoint.every_minutes=0",
              "data.global_batch_size=16", "data.micro_batch_size=4", "data.seq_len=128"]
    print(f"cpu cores={os.cpu_count()} model={args.model} global batch 16 x 128 tokens, {args.steps} steps")
    header = f"{'layout':<15}{'procs':>6}{'step s':>9}{'tokens/s':>10}{'vs single':>11}"
    print(header)
    print("-" * len(header))
    baseline = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            run_dir = Path(tmp) / name.replace(" ", "_")
            subprocess.run(
                [sys.executable, str(ROOT / "recipes" / "pretrain.py"), *common, *LAYOUTS[name], f"hydra.run.dir={run_dir}"],
                check=True, cwd=ROOT, capture_output=True, env={**os.environ, "WANDB_MODE": "disabled"},
            )
            seconds = statistics.median(step_times(run_dir)[2:])
            baseline = baseline or seconds
            procs = next(int(o.split("=")[1]) for o in LAYOUTS[name] if o.startswith("trainer.devices="))
            print(f"{name:<15}{procs:>6}{seconds:>9.3f}{16 * 128 / seconds:>10.0f}{baseline / seconds:>10.2f}x")


if __name__ == "__main__":
    main()
