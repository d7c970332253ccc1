"""The planner's per-GPU memory estimate against a real CPU training step, as a table.

Each case runs in a fresh process: real ``PretrainModule`` steps (manual optimization: micro-batches,
AdamW, clipping) under a Lightning ``Trainer`` on CPU, fed random token windows. Measured = the
peak resident memory (VmHWM) above the level just before the model is built, so it holds the
weights, gradients, AdamW moments, activations, logits and temporaries. Estimated =
:func:`dsl_lit.scaling.planner.estimate_memory` for the same model and layout (no cluster: no
reserved memory, no fragmentation).

The worker runs with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves every tensor above 64 KiB
with its own mapping and unmaps it when freed, so resident memory follows the live tensors (with
its default, adaptive threshold, freed activations stay resident and are counted again as the
next allocations land elsewhere: 16-40% more on these cases, allocator overhead and not tensors).

    .venv/bin/python -m benchmarks.planner_memory

Measured 2026-11-22 on the shared 2-core CPU (torch 2.13, fp32, 3 steps each, 142 s):

    model                batch micro  seq recompute  estimated MiB measured MiB   error
    deepseek_llm_tiny        8     8  256 none               363.8        405.8  -10.4%
    deepseek_llm_tiny       16     4  512 none               363.8        434.0  -16.2%
    deepseek_llm_tiny        8     8  512 full               335.3        340.7   -1.6%
    deepseek_v3_tiny         8     8  256 none               723.8        748.5   -3.3%

The estimate runs low: it leaves out transient buffers (AdamW's foreach temporaries, autograd's
gradient of each activation while it is consumed) beyond the one block's working set it counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

WORKER = r"""
import json, sys
import lightning as L
import torch
from torch.utils.data import DataLoader
from dsl_lit.config.memory import MemoryConfig
from dsl_lit.config.model import ModelConfig
from dsl_lit.training import PretrainModule
from dsl_lit.config.optim import OptimConfig, ScheduleConfig

name, batch, micro, seq, recompute, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
torch.manual_seed(0)
cfg = ModelConfig.from_name(name, max_seq_len=max(seq, 64))
windows = torch.randint(0, cfg.vocab_size, (steps, batch, seq + 1))
loader = DataLoader([{"input_ids": w[:, :-1], "labels": w[:, 1:]} for w in windows], batch_size=None)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

module = PretrainModule(cfg, OptimConfig(lr=1e-3), ScheduleConfig(name="constant", warmup_steps=0), micro,
                        total_steps=steps, memory=MemoryConfig(recompute=recompute))
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from the current RSS
    f.write("5")
trainer.fit(module, train_dataloaders=loader)
print(json.dumps({"measured": status("VmHWM") - base}))
"""

CASES = [  # model, global batch, micro-batch, seq_len, recompute
    ("deepseek_llm_tiny", 8, 8, 256, "none"),
    ("deepseek_llm_tiny", 16, 4, 512, "none"),
    ("deepseek_llm_tiny", 8, 8, 512, "full"),
    ("deepseek_v3_tiny", 8, 8, 256, "none"),
]


def measure(model: str, batch: int, micro: int, seq: int, recompute: str, steps: int = 3) -> float:
    """Peak resident bytes of the training steps above the pre-model level, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", WORKER, model, str(batch), str(micro), str(seq), recompute, str(steps)],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}).stdout.strip().splitlines()[-1]
    return float(json.loads(out)["measured"])


def estimate(model: str, batch: int, micro: int, seq: int, recompute: str) -> float:
    from dsl_lit.config.model import ModelConfig
    from dsl_lit.scaling.planner import PlanLayout, estimate_memory

    cfg = ModelConfig.from_name(model, max_seq_len=max(seq, 64))
    layout = PlanLayout.of(global_batch_size=batch, micro_batch_size=micro, seq_len=seq, recompute=recompute,
                           precision="fp32", zero1=False)
    return estimate_memory(cfg, layout.validate(cfg)).total


def main() -> None:
    header = f"{'model':<20}{'batch':>6}{'micro':>6}{'seq':>5} {'recompute':<10}{'estimated MiB':>14}{'measured MiB':>13}{'error':>8}"
    print(header)
    print("-" * len(header))
    for case in CASES:
        est, meas = estimate(*case), measure(*case)
        print(f"{case[0]:<20}{case[1]:>6}{case[2]:>6}{case[3]:>5} {case[4]:<10}{est / 2**20:>14.1f}{meas / 2**20:>13.1f}"
              f"{est / meas - 1:>+8.1%}")


if __name__ == "__main__":
    main()
