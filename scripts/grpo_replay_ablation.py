"""GRPO on a tiny DeepSeek-V3 with rollout routing replay off and on, over seeds: the README's ablation.

    python scripts/grpo_replay_ablation.py                      # 3 seeds x {off, on}, ~15 min on 2 CPU cores
    python scripts/grpo_replay_ablation.py --seeds 1 2 --steps 10 --out /tmp/ablation

One cold start (SFT of the random MoE on the task's imperfect replies) is shared by every run; each
run then takes ``--steps`` GRPO rollouts with ``grpo.iterations=2`` (the second optimizer step on
a rollout is off-policy: its router has moved since sampling, the case replay is for) in bf16 (the
sampler's KV-cache forward and the training forward round differently). Printed per run and as
mean +- std per arm: the mean reward over the last quarter of the steps, held-out greedy accuracy
at the end, the router-flip rate (share of tokens whose training-forward top-k differs from the
sampler's, mean over routers and steps), the policy-ratio clip fraction and the rollout/training
log-prob gap.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["model=deepseek_v3_tiny", "model.n_layers=3", "precision=bf16", "logger=csv", "trainer.progress_bar=false",
          "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=0", "checkpoint.every_minutes=0"]


def recipe(run_dir: Path, *overrides: str) -> None:
    command = [sys.executable, str(ROOT / "recipes" / "grpo.py"), f"hydra.run.dir={run_dir}", *COMMON, *overrides]
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "WANDB_MODE": "offline"}).returncode
    if code:
        raise SystemExit(f"{' '.join(command)} exited {code}; log {log}")


def summary(run_dir: Path) -> dict[str, float]:
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r.get("reward/mean")]
    last = train[-max(1, len(train) // 4):]

    def mean(key: str, of: list[dict]) -> float:
        values = [float(r[key]) for r in of if r.get(key)]
        return sum(values) / len(values) if values else float("nan")

    accuracy = [float(r["eval/accuracy"]) for r in rows if r.get("eval/accuracy")]
    return {"reward (last quarter)": mean("reward/mean", last), "held-out accuracy": accuracy[-1],
            "router flips": mean("train/router_flips", train), "clip fraction": mean("train/clip_fraction", train),
            "rollout logp gap": mean("train/rollout_logp_gap", train)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "grpo_replay_ablation")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cold = args.out / "cold"
    if not (cold / "cold_start" / "checkpoints").is_dir():
        recipe(cold, "grpo.cold_start_steps=40", "trainer.max_steps=1")
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for seed in args.seeds:
        for arm, replay in (("off", "false"), ("on", "true")):
            run_dir = args.out / f"replay_{arm}_seed{seed}"
            log = run_dir.with_suffix(".log")
            if not (log.is_file() and "final loss" in log.read_text()):  # not finished: run (again)
                shutil.rmtree(run_dir, ignore_errors=True)
                recipe(run_dir, f"init_from={cold / 'cold_start'}", f"grpo.routing_replay={replay}", f"trainer.seed={seed}",
                       "grpo.iterations=2", f"trainer.max_steps={2 * args.steps}", "grpo.eval_every_n_steps=0")
            results[arm].append(summary(run_dir))
            print(f"replay {arm}, seed {seed}: " + ", ".join(f"{k} {v:.4g}" for k, v in results[arm][-1].items()), flush=True)
    keys = list(results["off"][0])
    print("\n| replay | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for arm, runs in results.items():
        cells = [f"{statistics.mean(r[k] for r in runs):.4g} +- {statistics.pstdev([r[k] for r in runs]):.2g}" for k in keys]
        print(f"| {arm} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
