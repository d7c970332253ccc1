"""One training step (forward + backward + AdamW) on one GPU: ours against transformers, eager against
``torch.compile`` (per block, as ``trainer.compile``), bf16 autocast against each FP8 recipe.

Two models, 4 x 2048 tokens by default (the issue's comparison points):

* dense ~1B: DeepSeek LLM layout, d 2048, 16 layers, vocab 32,000 (``LlamaForCausalLM`` on the
  transformers side);
* V3-style MoE ~0.8B: d 1024, 8 layers (the first dense), MLA, 64 routed experts top-6 in 8 groups
  (4 searched), one shared expert, ``expert_backend=grouped_mm`` (``DeepseekV3ForCausalLM``).

For each variant it prints the median step time, tokens/s, MFU (the analytical training FLOPs of
``dsl_lit.flops`` over the device's dense bf16 peak; FP8 variants too, so their MFU says how much
of the bf16 peak they beat), peak memory, and the first step's time (compilation and Triton
autotuning included). Each variant gets a fresh copy of the same weights and is timed alone
(a ~1B model with AdamW holds ~16 GB: the variants cannot all stay on the GPU to be interleaved).

    python -m benchmarks.gpu_train_step [--models dense,moe] [--repeats 10] [--variants ...]
    python -m benchmarks.gpu_train_step --smoke   # tiny shapes, any device (the CPU suite runs it)

``scripts/gpu_check.sh`` runs it after the GPU tests. The headline lines hold the issue's targets:
dense MFU >= 55% with compile, FP8 tensorwise >= 1.2x the bf16 + compile step, MoE MFU >= 30%,
blockwise first step <= 60 s; each printed as soon as its rows are measured.

``--floors`` (the check) also holds the rows to floors that only a fallback to a slow path breaks
(:data:`FLOORS`), each printed as a headline (``floor ...: ok`` or ``FAILED``) once its rows exist;
any failed floor makes the exit status 1. They were a timed test that re-measured the same rows
(80 s of a 5-minute check on an H200); a benchmark is where a speed target belongs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.headline import headline
from dsl_lit.config.optim import OptimConfig
from dsl_lit.flops import training_flops_per_token
from dsl_lit.hf.io import adapter_for_family
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.ops import cross_entropy
from dsl_lit.optim import build_optimizer
from dsl_lit.parallel.model_transforms import compile_blocks
from dsl_lit.precision.fp8 import FP8_RECIPES, apply_fp8
from dsl_lit.training.callbacks.throughput import spec_sheet_peak

VARIANTS = (
    "ours bf16", "ours bf16 compile", "ours fp8_tensorwise compile", "ours fp8_rowwise compile",
    "ours fp8_blockwise", "ours fp8_blockwise compile", "transformers bf16", "transformers bf16 compile",
)


def valid_variant(name: str) -> bool:
    """``<ours|transformers> <precision>[ compile]``: bf16 or an FP8 recipe (ours only)."""
    words = name.split()
    if len(words) not in (2, 3) or (len(words) == 3 and words[2] != "compile"):
        return False
    if words[0] == "transformers":
        return words[1] == "bf16"
    return words[0] == "ours" and words[1] in ("bf16", *FP8_RECIPES)


def model_configs(smoke: bool) -> dict[str, ModelConfig]:
    """The issue's two models (``smoke``: the same layouts at toy size)."""
    if smoke:
        return {
            "dense": ModelConfig.from_name("deepseek_llm_tiny", n_layers=2, vocab_size=2048, max_seq_len=1024),
            "moe": ModelConfig.from_name("deepseek_v3_tiny", n_layers=2, mtp_depth=0, vocab_size=2048,
                                         seq_balance_alpha=0.0, expert_backend="grouped_mm", max_seq_len=1024),
        }
    return {
        "dense": ModelConfig.from_name(
            "deepseek_llm_tiny", d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_hidden=5504,
            vocab_size=32000, max_seq_len=4096,
        ),
        "moe": ModelConfig.from_name(
            "deepseek_v3_tiny", d_model=1024, n_layers=8, n_dense_layers=1, n_heads=16, ffn_hidden=2816,
            q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            n_routed_experts=64, n_activated_experts=6, n_shared_experts=1, moe_ffn_hidden=512,
            n_expert_groups=8, n_limited_groups=4, mtp_depth=0, seq_balance_alpha=0.0,
            vocab_size=32000, expert_backend="grouped_mm", max_seq_len=4096,
        ),
    }


def transformers_model(cfg: ModelConfig) -> torch.nn.Module:
    """transformers' implementation of ``cfg`` (random weights; the step time is what counts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(adapter_for_family(cfg.family).config_to_hf(cfg))
    hf.pop("architectures", None)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Result:
    first_s: float
    step_s: float
    peak_bytes: int


def build_variant(name: str, cfg: ModelConfig, base: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    if name.startswith("transformers"):
        model = transformers_model(cfg)
    else:
        model = copy.deepcopy(base)
        recipe = name.split()[1]
        if recipe.startswith("fp8"):
            apply_fp8(model, recipe)
    model = model.to(device).train()
    if name.endswith("compile"):
        if name.startswith("transformers"):
            for layer in model.model.layers:
                layer.compile()
        else:
            compile_blocks(model)
    return model


def make_step(model: torch.nn.Module, tokens: torch.Tensor, hf: bool) -> Callable[[], None]:
    device = tokens.device
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))  # as training builds it (fused where it applies)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=tokens[:, :-1]).logits if hf else model(tokens[:, :-1])
            loss = cross_entropy(logits, tokens[:, 1:], reduction="mean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(name: str, cfg: ModelConfig, base: torch.nn.Module, tokens: torch.Tensor, repeats: int) -> Result:
    """Build the variant, time its first step (compile / autotune included) and a second warm-up
    step, then the median of ``repeats`` steps; free it. One variant at a time: a ~1B model with
    AdamW holds ~16 GB, so the variants cannot all stay on the GPU to be interleaved."""
    device = tokens.device
    model = build_variant(name, cfg, base, device)
    step = make_step(model, tokens, hf=name.startswith("transformers"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    first = time.perf_counter() - start
    step()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del step, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Result(first, statistics.median(times), peak)


def device_description(device: torch.device) -> str:
    versions = f"torch {torch.__version__}"
    with contextlib.suppress(Exception):
        import torchao

        versions += f", torchao {torchao.__version__}"
    with contextlib.suppress(Exception):
        import transformers

        versions += f", transformers {transformers.__version__}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}); {versions}"
    return f"CPU {platform.processor() or platform.machine()}; {versions}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--moe-variants", default=None, help="for the MoE model (default: --variants)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="toy shapes (2 x 64 tokens), 2 repeats")
    parser.add_argument("--floors", action="store_true", help="hold the rows to FLOORS: exit 1 if one fails")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.batch, args.seq, args.repeats = 2, 64, 2
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if not valid_variant(v)]
    if unknown:
        raise SystemExit(f"--variants: cannot read {unknown}: '<ours|transformers> <bf16|fp8 recipe>[ compile]' "
                         f"(transformers: bf16 only), e.g. {list(VARIANTS[:3])}")
    peak_tflops = spec_sheet_peak(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
    print(f"device: {device_description(device)}; bf16 peak {peak_tflops or 'unknown'} TFLOP/s; "
          f"{args.batch} x {args.seq} tokens, fwd + bwd + AdamW, bf16 autocast, median of {args.repeats}")
    tokens_per_step = args.batch * args.seq
    results: dict[str, dict[str, Result]] = {}
    reported: set[str] = set()
    failed: list[str] = []
    for model_name in args.models.split(","):
        cfg = model_configs(args.smoke)[model_name]
        torch.manual_seed(0)
        base = build_model(cfg)
        n_params = sum(p.numel() for p in base.parameters())
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
        wanted = variants if model_name == "dense" or args.moe_variants is None else args.moe_variants.split(",")
        flops = training_flops_per_token(cfg, args.seq) * tokens_per_step
        print(f"\n{model_name}: {n_params / 1e9:.2f}B parameters ({cfg.family})")
        print(f"{'variant':<30}{'ms':>9}{'tokens/s':>11}{'MFU':>8}{'peak GiB':>10}{'first step s':>14}"
              f"{'vs bf16 eager':>15}", flush=True)
        results[model_name] = {}
        for name in wanted:  # each row as soon as it is measured: a timeout keeps what was done
            r = results[model_name][name] = measure(name, cfg, base, tokens, args.repeats)
            reference = results[model_name].get("ours bf16")
            mfu = f"{flops / r.step_s / (peak_tflops * 1e12):.1%}" if peak_tflops else "-"
            ratio = f"{reference.step_s / r.step_s:.2f}x" if reference else "-"
            print(f"{name:<30}{r.step_s * 1e3:>9.1f}{tokens_per_step / r.step_s:>11.0f}{mfu:>8}"
                  f"{r.peak_bytes / 2**30:>10.2f}{r.first_s:>14.1f}{ratio:>15}", flush=True)
            # each headline the moment its rows exist: a deadline that cuts the run keeps them
            report_headlines(results, args.seq, tokens_per_step, peak_tflops, args.smoke, reported)
            if args.floors:
                failed = check_floors(results, args.seq, tokens_per_step, peak_tflops, args.smoke, reported)
    if args.floors and failed:
        raise SystemExit("floors failed (a slow path?): " + "; ".join(failed))


@dataclass(frozen=True)
class Floor:
    """A figure that only a slow path (math attention, fp32 GEMMs, a block left eager, FP8's
    reference path, experts looping instead of the grouped GEMM) takes past ``limit``."""

    what: str
    model: str
    variants: tuple[str, ...]
    limit: float
    unit: str
    """"%": MFU of ``variants[0]`` must exceed ``limit``; "x": the step of ``variants[0]`` over that of
    ``variants[1]`` must stay under ``limit``."""


FLOORS = (
    # measured 50.2-51.3% on an H200 (2026-11-27, three runs; 50.9% on 2026-11-29)
    Floor("dense MFU, bf16 + compile", "dense", ("ours bf16 compile",), 40.0, "%"),
    # measured 0.89-0.95x: torchao's reference path or unfused casts cost far more (eager FP8: 2.7x)
    Floor("dense fp8_tensorwise + compile step over bf16 + compile", "dense",
          ("ours fp8_tensorwise compile", "ours bf16 compile"), 1.1, "x"),
    # measured 11.7-13.2%: the experts looping over a per-expert matmul fall under 8%
    Floor("moe MFU, bf16 eager", "moe", ("ours bf16",), 8.0, "%"),
)


def check_floors(results: dict[str, dict[str, Result]], seq: int, tokens: int, peak: float | None,
                 smoke: bool, reported: set[str]) -> list[str]:
    """Each :data:`FLOORS` entry whose rows exist (an MFU only with a known peak), printed once as a
    headline; returns the failed ones' descriptions (all failures so far, printed or not)."""
    failed = []
    for floor in FLOORS:
        rows = [results.get(floor.model, {}).get(v) for v in floor.variants]
        if any(r is None for r in rows) or (floor.unit == "%" and not peak):
            continue
        if floor.unit == "%":
            cfg = model_configs(smoke)[floor.model]
            value = 100 * training_flops_per_token(cfg, seq) * tokens / rows[0].step_s / (peak * 1e12)
            ok, goal = value > floor.limit, f"floor > {floor.limit:g}%"
        else:
            value = rows[0].step_s / rows[1].step_s
            ok, goal = value < floor.limit, f"floor < {floor.limit:g}x"
        if not ok:
            failed.append(f"{floor.what}: {value:.4g} {floor.unit}, {goal}")
        if floor.what not in reported:
            reported.add(floor.what)
            headline(floor.what, value, floor.unit, f"{goal}: {'ok' if ok else 'FAILED'}")
    return failed


def report_headlines(results: dict[str, dict[str, Result]], seq: int, tokens: int, peak: float | None,
                     smoke: bool, reported: set[str]) -> None:
    """The issue's targets, each once, as soon as the variants it compares have run."""

    def once(what: str, value: float, unit: str, goal: str = "") -> None:
        if what not in reported:
            reported.add(what)
            headline(what, value, unit, goal)

    for model_name, goal in (("dense", ">= 55%"), ("moe", ">= 30%")):
        r = results.get(model_name, {}).get("ours bf16 compile")
        if r is not None and peak:
            cfg = model_configs(smoke)[model_name]
            once(f"{model_name} MFU, bf16 + compile", 100 * training_flops_per_token(cfg, seq) * tokens
                 / r.step_s / (peak * 1e12), "%", goal)
    for model_name, rs in results.items():
        base = rs.get("ours bf16 compile")
        for recipe in ("fp8_tensorwise", "fp8_rowwise"):
            r = rs.get(f"ours {recipe} compile")
            if base and r:
                once(f"{model_name} {recipe} + compile vs bf16 + compile", base.step_s / r.step_s, "x",
                     ">= 1.2x" if (model_name, recipe) == ("dense", "fp8_tensorwise") else "")
        r = rs.get("ours fp8_blockwise")
        if r:
            once(f"{model_name} fp8_blockwise first step (Triton autotune)", r.first_s, "s", "<= 60 s")
        ours, theirs = rs.get("ours bf16"), rs.get("transformers bf16")
        if ours and theirs:
            once(f"{model_name} train step vs transformers, bf16 eager", theirs.step_s / ours.step_s, "x")


if __name__ == "__main__":
    main()
