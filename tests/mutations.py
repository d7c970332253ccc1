"""Mutation check: inject known classes of bugs one at a time and show that the suite catches each.

A test that passes whatever the code does is worse than none. This script copies the repository
(the files git tracks or would track) to a temporary directory, and for each mutation below
replaces one snippet of source there, runs the tests that should catch it, and restores the file.
It prints one row per mutation (tests run, failed, seconds) and exits 1 if a mutation survived
(no test failed) or if the unmutated code does not pass the same tests (the baseline, run first).

Not part of ``make test`` (it runs selected tests ~10 times). From the repository root:

    .venv/bin/python tests/mutations.py                # every mutation, with the baseline
    .venv/bin/python tests/mutations.py --only mtp     # mutations whose name contains "mtp"
    .venv/bin/python tests/mutations.py --list         # what would be injected, and where

A mutation names its snippet, not its file: the file is whichever one under ``src/`` holds the
snippet exactly once, so the check survives code moving between files; a snippet found nowhere
(the code was rewritten) stops the script with the mutation's name, to be updated here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    old: str
    """Exact source snippet (unique under src/) to replace."""
    new: str
    tests: tuple[str, ...]
    """pytest node ids or paths, relative to the repository root."""


REFERENCES = "tests/unit/training/test_objective_references.py"
PRETRAIN_GRADIENTS = f"{REFERENCES}::test_pretrain_gradients_equal_autograd_of_the_v3_objective_across_the_mtp_weight_boundary"

MUTATIONS = (
    Mutation(
        "dropped MTP loss term",
        "objective = objective + self.objective.mtp_weight_at(self.progress) * mtp_loss",
        "objective = objective + 0.0 * mtp_loss",
        (PRETRAIN_GRADIENTS, "tests/unit/training/test_pretrain_module.py"),
    ),
    Mutation(
        "dropped balance loss term",
        "            objective = objective + balance\n",
        "            objective = objective + 0.0 * balance\n",
        (PRETRAIN_GRADIENTS, "tests/unit/training/test_pretrain_module.py"),
    ),
    Mutation(
        "skipped fp16 unscale",
        "grad_norm = self.finish_gradients(optimizer.optimizer, self.optim_config.grad_clip or None, scale)",
        "grad_norm = self.finish_gradients(optimizer.optimizer, self.optim_config.grad_clip or None, 1.0)",
        (f"{REFERENCES}::test_fp16_step_matches_fp32_with_clipping_configured", "tests/unit/precision/test_precision.py"),
    ),
    Mutation(
        "flipped sign in the bias update",
        "self.expert_bias += rate * torch.sign(load.mean() - load)",
        "self.expert_bias -= rate * torch.sign(load.mean() - load)",
        ("tests/e2e/parallel/test_bias_balancing.py", "tests/unit/models/test_model_v3.py", "tests/unit/training/test_pretrain_module.py"),
    ),
    Mutation(
        "biased scores leaking into gate values",
        "weights = scores.gather(1, indices)",
        "weights = (scores + self.expert_bias).gather(1, indices)",
        ("tests/unit/models/test_model_v3.py",),
    ),
    Mutation(
        "wrong dp data offset in the sampler",
        "start = batch_start + self.dp_rank * self.local_batch_size",
        "start = batch_start + self.dp_rank * self.global_batch_size",
        ("tests/unit/data/test_sampler.py", "tests/unit/data/test_datamodule.py"),
    ),
    Mutation(
        "swapped loss normalizer in GRPO",
        'normalizers["tokens"] = local if self.grpo.loss_type == "bnpo" else normalizers["targets"]',
        'normalizers["tokens"] = normalizers["targets"] if self.grpo.loss_type == "bnpo" else local',
        ("tests/e2e/parallel/test_grpo_data_parallel.py",),
    ),
    Mutation(
        "a balance-loss term with both alphas 0",
        "        if not (self.seq_balance_alpha or self.batch_balance_alpha):\n            return None\n",
        "        if not (self.seq_balance_alpha or self.batch_balance_alpha):\n            return scores.sum() * 0.0\n",
        ("tests/unit/models/test_model_v3.py",),
    ),
    Mutation(
        "sdpa attention without the causal mask",
        "q, k, v, attn_mask=mask, is_causal=plain_causal, scale=scale, enable_gqa=True",
        "q, k, v, attn_mask=mask, is_causal=False, scale=scale, enable_gqa=True",
        ("tests/unit/models/test_model.py",),
    ),
    Mutation(
        "MTP weight of the other phase",
        "return piecewise_constant(progress, self.mtp_weight, self.mtp_weight_boundaries)",
        "return piecewise_constant(progress, self.mtp_weight[::-1], self.mtp_weight_boundaries)",
        (PRETRAIN_GRADIENTS, "tests/unit/training/test_pretrain_module.py"),
    ),
)


def repository_files(root: Path) -> list[str]:
    """The files git tracks or would track (untracked but not ignored), as in a fresh checkout."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name and (root / name).is_file()]


def locate(copy: Path, mutation: Mutation) -> Path:
    """The one file under src/ holding the mutation's snippet exactly once."""
    hits = [p for p in sorted((copy / "src").rglob("*.py")) if p.read_text().count(mutation.old)]
    if len(hits) != 1 or hits[0].read_text().count(mutation.old) != 1:
        where = ", ".join(str(p.relative_to(copy)) for p in hits) or "nowhere"
        raise SystemExit(f"mutation {mutation.name!r}: its snippet must occur once under src/, found in {where}; "
                         f"update it in tests/mutations.py:\n{mutation.old}")
    return hits[0]


def run_tests(copy: Path, tests: tuple[str, ...], report: Path) -> tuple[int, list[str], float]:
    """(tests run, names of those that failed or errored, seconds) of pytest on ``tests`` in the copy."""
    env = {**os.environ, "PYTHONPATH": f"{copy / 'src'}{os.pathsep}{copy}", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests],
                   cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    if not report.exists():  # pytest could not even start (an import error in conftest): caught
        return 0, ["(pytest did not start)"], seconds
    cases = list(ET.parse(report).getroot().iter("testcase"))
    report.unlink()
    ran = [c for c in cases if c.find("skipped") is None]
    failed = [c.get("name", "?") for c in ran if c.find("failure") is not None or c.find("error") is not None]
    return len(ran), failed, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutations whose name contains this text")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the tests on unmutated code")
    parser.add_argument("--list", action="store_true", help="list the mutations and where they apply")
    args = parser.parse_args()
    mutations = [m for m in MUTATIONS if args.only in m.name]
    with tempfile.TemporaryDirectory(prefix="dsl-lit-mutations-") as tmp:
        copy = Path(tmp) / "repo"
        for name in repository_files(ROOT):
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
        targets = {m.name: locate(copy, m) for m in mutations}
        if args.list:
            for m in mutations:
                print(f"{m.name}: {targets[m.name].relative_to(copy)} -> {' '.join(m.tests)}")
            return 0
        report = Path(tmp) / "report.xml"
        rows = [("mutation", "tests run", "failed", "seconds", "caught by")]
        survived = []
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
            ran, failed, seconds = run_tests(copy, tests, report)
            rows.append(("(none: baseline)", str(ran), str(len(failed)), f"{seconds:.0f}", ", ".join(failed)))
            if failed:
                survived.append("the baseline (unmutated code fails: the other rows say nothing)")
        for m in mutations:
            path = targets[m.name]
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new))
            try:
                ran, failed, seconds = run_tests(copy, m.tests, report)
            finally:
                path.write_text(original)
            rows.append((m.name, str(ran), str(len(failed)), f"{seconds:.0f}", ", ".join(failed)))
            print(f"{m.name}: {len(failed)} failed of {ran} ({seconds:.0f} s)", file=sys.stderr, flush=True)
            if not failed:
                survived.append(m.name)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, row in enumerate(rows):
        print(" | ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[4]]))
        if i == 0:
            print("-|-".join(["-" * w for w in widths] + ["-" * 9]))
    if survived:
        print(f"\nnot caught: {'; '.join(survived)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
