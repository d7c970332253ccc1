"""Peak memory and time of one training step with and without activation recompute, as a table.

Each mode runs in a fresh process (so peaks do not leak between them): build the model, measure
resident memory, run forward + backward on one batch, and report the peak resident memory above
the post-build level (activations, gradients and temporaries; the weights are excluded) and the
step time (median of ``--repeats`` steps after a warm-up).

    .venv/bin/python -m benchmarks.recompute_memory [--model deepseek_v3_tiny] [--batch 8] [--seq 512]

Measured 2026-11-22 on the 2-core CPU (deepseek_v3_tiny, 8 x 512 tokens, fp32):

    recompute    peak MiB  vs none   step s  vs none
    none              560    1.00x     1.47    1.00x
    selective         388    0.69x     1.66    1.13x
    full              208    0.37x     2.23    1.51x
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

WORKER = r"""
import json, resource, statistics, sys, time
import torch
from dsl_lit.memory.recompute import apply_recompute
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.ops import cross_entropy

model_name, mode, batch, seq, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
model = build_model(ModelConfig.from_name(model_name, max_seq_len=max(seq, 64)))
apply_recompute(model, mode)
tokens = torch.randint(0, model.config.vocab_size, (batch, seq))

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

def step():
    out = model(tokens)
    loss = cross_entropy(out, tokens)
    balance = model.balance_loss()
    (loss + balance if balance is not None else loss).backward()
    model.zero_grad(set_to_none=False)

step()  # warm-up: gradients allocated, kernels picked
base = rss_kib()
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")
times = []
for _ in range(repeats):
    t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
print(json.dumps({"peak_mib": (peak - base) / 1024, "step_s": statistics.median(times)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek_v3_tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"model={args.model} batch {args.batch} x {args.seq} tokens, fp32, one process")
    header = f"{'recompute':<11}{'peak MiB':>10}{'vs none':>9}{'step s':>9}{'vs none':>9}"
    print(header)
    print("-" * len(header))
    base = None
    for mode in ("none", "selective", "full"):
        out = subprocess.run(
            [sys.executable, "-c", WORKER, args.model, mode, str(args.batch), str(args.seq), str(args.repeats)],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
        result = json.loads(out)
        base = base or result
        print(f"{mode:<11}{result['peak_mib']:>10.0f}{result['peak_mib'] / base['peak_mib']:>8.2f}x"
              f"{result['step_s']:>9.2f}{result['step_s'] / base['step_s']:>8.2f}x")


if __name__ == "__main__":
    main()
