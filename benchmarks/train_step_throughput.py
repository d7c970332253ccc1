"""Training-step throughput and MFU of our models against transformers' on the same weights.

Prints one table measured in one run: tokens/s and MFU of a full training step (forward, backward,
AdamW step) for the tiny and ~100M DeepSeek LLM presets, in fp32 and under bf16 autocast, and the
ratio to `transformers`' LlamaForCausalLM built from the very same weights (via save_pretrained).

    .venv/bin/python benchmarks/train_step_throughput.py [--steps 5] [--batch 4] [--seq 256]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time

import torch

from dsl_lit.flops import training_flops_per_token
from dsl_lit.hf import save_pretrained
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.ops import cross_entropy
from dsl_lit.precision.gemm_speed import measure_matmul_tflops


def step_seconds(model: torch.nn.Module, tokens: torch.Tensor, bf16: bool, steps: int, hf: bool) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    times = []
    for i in range(steps + 1):  # the first step warms up kernels and allocates optimizer state
        start = time.perf_counter()
        with autocast:
            logits = model(input_ids=tokens[:, :-1]).logits if hf else model(tokens[:, :-1])
            loss = cross_entropy(logits, tokens[:, 1:], reduction="mean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["deepseek_llm_tiny", "deepseek_llm_100m"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    args = parser.parse_args()
    torch.manual_seed(0)
    peaks = {False: measure_matmul_tflops(torch.float32), True: measure_matmul_tflops(torch.bfloat16)}
    print(f"threads={torch.get_num_threads()}  measured GEMM peak: fp32 {peaks[False]:.3f} TFLOP/s, "
          f"bf16 {peaks[True]:.3f} TFLOP/s")
    header = f"{'model':<20}{'params':>9}{'prec':>6}{'tokens/s':>11}{'MFU':>8}{'hf tok/s':>10}{'ours/hf':>9}"
    print(header)
    print("-" * len(header))
    for name in args.models:
        cfg = ModelConfig.from_name(name)
        model = build_model(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
        flops_per_token = training_flops_per_token(cfg, args.seq)
        hf_model = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            with tempfile.TemporaryDirectory() as tmp:
                save_pretrained(model, tmp)
                hf_model = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa")
        for bf16 in [p == "bf16" for p in args.precisions]:
            n_tokens = args.batch * args.seq
            ours = n_tokens / step_seconds(model, tokens, bf16, args.steps, hf=False)
            mfu = ours * flops_per_token / (peaks[bf16] * 1e12)
            hf_cells = f"{'-':>10}{'-':>9}"
            if hf_model is not None:
                theirs = n_tokens / step_seconds(hf_model, tokens, bf16, args.steps, hf=True)
                hf_cells = f"{theirs:>10.0f}{ours / theirs:>8.2f}x"
            prec = "bf16" if bf16 else "fp32"
            print(f"{name:<20}{model.num_params() / 1e6:>8.1f}M{prec:>6}{ours:>11.0f}{mfu:>8.1%}{hf_cells}")


if __name__ == "__main__":
    main()
