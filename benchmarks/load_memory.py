"""Peak host memory per rank of loading a big HF checkpoint: one process vs pipeline parallel (pp=2)
vs expert parallel (ep=2), as a table.

Each rank builds the model on the meta device, cuts it down as the strategy does (pipeline stages
by ``split_layers`` / ``prune_to_stages``, experts by ``apply_expert_parallel``) and reads its own
tensors from the safetensors shards (``StartingWeights.load``, what ``init_from`` runs). Every
layout runs in fresh processes (gloo); the peak is the rank's ``VmHWM`` after loading (Python and
torch included: the "before" column is the peak before reading any weight).

The checkpoint is written once (``--dir``): a DeepSeek-V2-Lite-shaped model (d_model 2048, 64
experts of 1408 + 2 shared, vocab 102400) with ``--layers`` layers, bf16, 2 GB shards.

    .venv/bin/python -m benchmarks.load_memory [--layers 4] [--dtype bfloat16] [--dir DIR] [--before]

Measured 2026-11-23 on the 2-core, 23 GiB CPU machine (GiB; "holds": the rank's tensors after
loading, "read": bytes read from the files, "before": peak RSS before reading any weight):

    4 layers (2.25 B parameters, 4.20 GiB in bf16), loaded in bf16
    layout        rank  holds GiB  read GiB  before GiB  peak GiB  load s
    one process      0       4.20      4.20        0.43      5.06    13.0
    pp=2             0       2.72      2.72        0.44      3.19     8.2
    pp=2             1       1.48      1.48        0.44      2.33     3.8
    ep=2             0       2.65      2.65        0.44      3.51    16.5
    ep=2             1       2.65      2.65        0.44      3.51    17.1

    the same, loaded in fp32 (the training dtype)
    one process      0       8.40      4.20        0.43      9.26    23.3
    pp=2             0       5.44      2.72        0.44      5.90    18.5
    pp=2             1       2.96      1.48        0.44      3.81     9.8
    ep=2             0       5.31      2.65        0.44      6.16    33.2
    ep=2             1       5.31      2.65        0.44      6.19    31.5

    2 layers (1.09 B parameters), fp32, with --before (each rank before this loader, whatever the
    layout: the whole checkpoint read, the whole model built and loaded, then pruned)
    before (any)     0       4.04      2.02        0.43      8.53    16.6
    one process      0       4.04      2.02        0.43      4.89     3.9
    pp=2             0       1.08      0.54        0.44      1.61     2.6
    pp=2             1       2.96      1.48        0.43      3.81     5.4
    ep=2             0       3.01      1.51        0.44      3.88     5.2
    ep=2             1       3.01      1.51        0.44      3.88     4.9

The peak is what a rank holds plus ~0.45 GiB of Python and torch plus the largest tensor read
(the 102400 x 2048 embedding); the stages of pp=2 are split by compute (rank 0: the embedding
and 2-3 layers), so they do not hold equal shares.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.processes import free_port

WRITER = r"""
import sys, torch
from dsl_lit.hf import save_pretrained
from dsl_lit.models import ModelConfig, build_model
layers, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)  # build in bf16: the whole model once, never in fp32
model = build_model(ModelConfig.from_name("deepseek_v2_lite", n_layers=layers))
save_pretrained(model, out, dtype="bfloat16", max_shard_size="2GB")
print(model.num_params())
"""

WORKER = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from dsl_lit.memory.host import peak_rss_bytes
from dsl_lit.models import build_model
from dsl_lit.parallel.expert_parallel import apply_expert_parallel
from dsl_lit.utils.materialise import local_target
from dsl_lit.parallel.pipeline import prune_to_stages, split_layers
from dsl_lit.training.pretrained import StartingWeights

path, layout, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
if world > 1:
    dist.init_process_group("gloo", rank=rank, world_size=world)
weights = StartingWeights.open(path)
with torch.device("meta"):
    model = build_model(weights.config)
if layout == "pp":
    prune_to_stages(model, split_layers(weights.config, world), [rank])
elif layout == "ep":
    apply_expert_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
before = peak_rss_bytes()
start = time.perf_counter()
if layout == "whole_twice":  # what every rank did before: the whole checkpoint read into a model,
    loaded = weights.whole_model("cpu", dtype)  # the whole model built with its random init, loaded
    model = build_model(weights.config).to(dtype)  # (then rank 0 broadcast, then the layout pruned)
    model.load_state_dict(loaded.state_dict())
else:
    weights.load(model, "cpu", dtype)
seconds = time.perf_counter() - start
held = sum(local_target(t)[0].numel() * local_target(t)[0].element_size()
           for t in {id(t): t for t in model.state_dict().values()}.values())
print(json.dumps({"rank": rank, "before": before, "peak": peak_rss_bytes(), "held": held,
                  "read": weights.hf.bytes_read, "seconds": seconds}))
if world > 1:
    dist.destroy_process_group()
"""

LAYOUTS = (("one process", "single", 1), ("pp=2", "pp", 2), ("ep=2", "ep", 2))
BEFORE = ("before (any)", "whole_twice", 1)
"""Per rank, whatever the layout, before meta-device loading (``--before``)."""
GIB = 2**30


def _run(path: Path, layout: str, world: int, dtype: str) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(path), layout, dtype], env={**env, "RANK": str(rank)},
                         stdout=subprocess.PIPE, text=True)
        for rank in range(world)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{layout} rank failed ({proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dsl_lit_v2_lite_shaped"))
    parser.add_argument("--before", action="store_true", help="also measure the path every rank took before")
    args = parser.parse_args()
    path = args.dir / f"{args.layers}_layers"
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-c", WRITER, str(args.layers), str(path)], check=True)
    stored = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"DeepSeek-V2-Lite-shaped, {args.layers} layers, {stored / GIB:.2f} GiB on disk (bf16); loaded in {args.dtype}")
    header = f"{'layout':<13}{'rank':>5}{'holds GiB':>11}{'read GiB':>10}{'before GiB':>12}{'peak GiB':>10}{'load s':>8}"
    print(header)
    print("-" * len(header))
    for name, layout, world in (BEFORE, *LAYOUTS) if args.before else LAYOUTS:
        for r in _run(path, layout, world, args.dtype):
            print(f"{name:<13}{r['rank']:>5}{r['held'] / GIB:>11.2f}{r['read'] / GIB:>10.2f}{r['before'] / GIB:>12.2f}"
                  f"{r['peak'] / GIB:>10.2f}{r['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
