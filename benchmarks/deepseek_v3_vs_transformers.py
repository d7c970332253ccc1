"""Our training step against transformers' on the same config and weights (DeepSeek-V3, or the
dense DeepSeek LLM with ``--family deepseek_llm``), and V3's MoE layer alone.

Prints two tables measured in one run, in one process, interleaving the candidates and taking
medians (so that load from other processes hits both sides alike):

1. forward + backward of the whole model (V3: hidden 256, 6 layers, 32 routed experts top-4;
   DeepSeek LLM: hidden 512, 8 layers, GQA, vocab 32,000 (~45M parameters); seq 256, batch 4 by
   default) for ours and `transformers`' model (DeepseekV3ForCausalLM or LlamaForCausalLM) loaded
   from our save_pretrained (the same weights, logits checked equal first). Then the ceiling: a
   profile of our step gives the share of its time in GEMMs and attention kernels, the work both
   sides do with the same torch kernels; transformers' step over that time is the ratio we would
   reach if every other op (norms, activations, routing, copies) took no time;
2. V3 only: one MoE layer (forward + backward) with our expert backends (``grouped_mm``: tokens
   sorted by expert, one grouped matmul per projection; ``split``: one matmul per expert slice;
   ``loop``: the naive per-expert masking loop) and transformers' DeepseekV3MoE with the same weights.

    .venv/bin/python -m benchmarks.deepseek_v3_vs_transformers [--family deepseek_v3|deepseek_llm]
        [--repeats 7] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.headline import headline
from benchmarks.timing import interleaved_medians
from dsl_lit.hf import save_pretrained
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.moe import MoE
from dsl_lit.ops import cross_entropy

GEMM_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")


def kernel_share(step: Callable[[], None], steps: int = 2) -> float:
    """Share of a step's op time (torch.profiler, self times) in GEMMs and attention kernels."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    kernels = sum(e.self_cpu_time_total for e in events if e.key in GEMM_KERNELS or "scaled_dot_product" in e.key)
    return kernels / total


def bench_config(args: argparse.Namespace, backend: str = "grouped_mm") -> ModelConfig:
    """The issue's comparison point; MTP and the balance loss off, as transformers has neither."""
    if args.family == "deepseek_llm":
        return ModelConfig.from_name("deepseek_llm_tiny", d_model=args.hidden or 512, n_layers=args.layers or 8,
                                     n_heads=8, n_kv_heads=4, ffn_hidden=1376, vocab_size=32000,
                                     max_seq_len=max(1024, args.seq))
    return ModelConfig.from_name(
        "deepseek_v3_tiny", d_model=args.hidden or 256, n_layers=args.layers or 6, n_routed_experts=args.experts,
        n_activated_experts=args.top_k, n_expert_groups=4, n_limited_groups=2, mtp_depth=0,
        seq_balance_alpha=0.0, expert_backend=backend, max_seq_len=max(1024, args.seq),
    )


def randomise(model: torch.nn.Module) -> None:
    """Random weights and expert bias, so routing is spread and the bias matters."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in model.parameters():
            if t.ndim > 1:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
        for name, t in model.named_buffers():
            if name.endswith("expert_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.01)


def train_step(model: torch.nn.Module, tokens: torch.Tensor, dtype: torch.dtype, hf: bool):
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    def run() -> None:
        with autocast:
            logits = model(input_ids=tokens[:, :-1]).logits if hf else model(tokens[:, :-1])
            loss = cross_entropy(logits, tokens[:, 1:], reduction="mean")
        loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def hf_moe_from_ours(ours: MoE, hf_config) -> torch.nn.Module:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    theirs = DeepseekV3MoE(hf_config)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.gate.expert_bias)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
        theirs.experts.down_proj.copy_(ours.experts.w2)
        for a, b in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            getattr(theirs.shared_experts, a).weight.copy_(getattr(ours.shared_experts, b).weight)
    return theirs


def layer_step(layer: torch.nn.Module, x: torch.Tensor):
    def run() -> None:
        x.grad = None
        layer(x).square().mean().backward()
        layer.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["deepseek_v3", "deepseek_llm"], default="deepseek_v3")
    parser.add_argument("--hidden", type=int, default=None, help="default: 256 (V3), 512 (DeepSeek LLM)")
    parser.add_argument("--layers", type=int, default=None, help="default: 6 (V3), 8 (DeepSeek LLM)")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = bench_config(args)
    ours = build_model(cfg)
    randomise(ours)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        theirs = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa")
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    with torch.no_grad():
        diff = (ours.eval()(tokens) - theirs.eval()(input_ids=tokens).logits).abs().max().item()
    ours.train(), theirs.train()
    moe = f"experts={args.experts} top-{args.top_k} " if args.family == "deepseek_v3" else ""
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"{args.family}: threads={torch.get_num_threads()} dtype={args.dtype} hidden={cfg.d_model} "
          f"layers={cfg.n_layers} {moe}params={n_params / 1e6:.1f}M batch={args.batch}x{args.seq}; "
          f"max |logits ours - transformers| = {diff:.2e}")

    ours_step = train_step(ours, tokens, dtype, hf=False)
    medians = interleaved_medians({"ours": ours_step, "transformers": train_step(theirs, tokens, dtype, hf=True)},
                                  args.repeats)
    n_tokens = args.batch * args.seq
    print(f"\n{'model fwd+bwd':<26}{'ms':>9}{'tokens/s':>11}{'vs transformers':>17}")
    for name, seconds in medians.items():
        print(f"{name:<26}{seconds * 1e3:>9.1f}{n_tokens / seconds:>11.0f}"
              f"{medians['transformers'] / seconds:>16.2f}x")
    share = kernel_share(ours_step)
    ceiling = medians["transformers"] / (share * medians["ours"])
    print(f"GEMMs and attention kernels: {share:.0%} of our step ({share * medians['ours'] * 1e3:.0f} ms); "
          f"ceiling with every other op free: {ceiling:.2f}x")
    name = "V3" if args.family == "deepseek_v3" else "DeepSeek LLM"
    goal = ">= 1.5x" if dtype == torch.float32 else ">= 1.2x"
    headline(f"{name} train step vs transformers, {args.dtype}", medians["transformers"] / medians["ours"], "x", goal)
    headline(f"{name} train step vs transformers, {args.dtype}, ceiling (GEMMs + attention only)", ceiling, "x")
    if args.family != "deepseek_v3":
        return

    layers = {}
    for backend in ("grouped_mm", "split", "loop"):
        torch.manual_seed(1)
        layer = MoE(bench_config(args, backend)).train()
        if layers:
            layer.load_state_dict(next(iter(layers.values())).state_dict())
        else:
            randomise(layer)
        layers[f"ours ({backend})"] = layer
    layers["transformers DeepseekV3MoE"] = hf_moe_from_ours(layers["ours (grouped_mm)"], theirs.config).train()
    x = torch.randn(args.batch, args.seq, cfg.d_model, requires_grad=True, dtype=dtype)
    with torch.no_grad():
        for layer in layers.values():
            layer.to(dtype)  # every layer in the input's dtype, the reference loop included
        reference = layers["ours (loop)"](x)
        for name, layer in layers.items():
            err = (layer(x) - reference).abs().max().item()
            assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"{name} differs from the loop by {err}"
    medians = interleaved_medians({name: layer_step(layer, x) for name, layer in layers.items()}, args.repeats)
    base = medians["ours (loop)"]
    print(f"\n{'MoE layer fwd+bwd':<30}{'ms':>9}{'vs per-expert loop':>20}")
    for name, seconds in medians.items():
        print(f"{name:<30}{seconds * 1e3:>9.1f}{base / seconds:>19.2f}x")


if __name__ == "__main__":
    main()
