"""AdamW's step on the tiny DeepSeek-V3's parameters: torch's per-tensor loop, foreach and fused kernels.

Why it matters on CPU: torch picks neither foreach nor fused there by default, and the per-tensor
loop is ~8% of a tiny V3 recipe step (py-spy); ``optim.fused: null`` (our default) takes the fused
kernel wherever it applies. Interleaved medians in one process, one thread by default.

    .venv/bin/python -m benchmarks.adamw_kernels [--layers 2] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.headline import headline
from benchmarks.timing import interleaved_medians
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.optim.adamw import AdamW, param_groups

KERNELS = {"per-tensor": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(ModelConfig.from_name("deepseek_v3_tiny", n_layers=args.layers))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers = {name: AdamW(param_groups(model, 0.1), lr=1e-6, **kw) for name, kw in KERNELS.items()}
    seconds = interleaved_medians({name: opt.step for name, opt in optimizers.items()}, args.repeats)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"deepseek_v3_tiny, {args.layers} layers, {params:.1f}M parameters, {args.threads} thread(s)")
    for name, s in seconds.items():
        print(f"{name:>10}: {s * 1e3:7.1f} ms per step")
    headline("AdamW step, per-tensor / fused", seconds["per-tensor"] / seconds["fused"], "x", "> 1 (fused is the default)")


if __name__ == "__main__":
    main()
