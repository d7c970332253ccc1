"""Peak memory per rank of RL sampling: from the training layout's shards vs from a whole copy.

GRPO samples completions from the policy and scores them under a frozen KL reference. Layouts
that cannot sample from their shards gather a whole copy of the policy on every rank (refreshed
after each optimizer step) and keep a whole reference; tensor, expert and pipeline parallelism
sample from the shards themselves with the reference sharded alike (issue 20, item 4). This runs
both on 2 gloo processes, for tp=2 and for pp=2, each variant in fresh processes (peak RSS is a
process's lifetime maximum): the model is built on the meta device and only this rank's part is
allocated, as the strategy does; then a reference, then generation and the reference's log-probs.

Prints per rank the peak RSS above the same process's RSS after imports and process-group start
(the peak reset there), and the ratio of the peaks.

    .venv/bin/python -m benchmarks.sharded_sampling_memory [--layers 8 --hidden 512 --vocab 32000]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.headline import headline
from benchmarks.processes import free_port, reset_peak_rss, status_kib
from dsl_lit.inference.generation import generate
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.parallel.full_state import full_state_dict
from dsl_lit.parallel.pipeline import prune_to_stages, split_layers, stages_of_rank
from dsl_lit.parallel.pipeline_inference import PipelinedInference
from dsl_lit.parallel.tensor_parallel import apply_tensor_parallel
from dsl_lit.posttrain.logps import token_logps
from dsl_lit.utils.materialise import materialise


def start_measuring() -> float:
    """Reset the process's peak RSS to its current RSS; returns that RSS in MiB."""
    if not reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only")
    return status_kib("VmRSS") / 1024


def peak_mib() -> float:
    return status_kib("VmHWM") / 1024


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig.from_name("deepseek_llm_tiny", vocab_size=args.vocab, n_layers=args.layers,
                                 d_model=args.hidden, n_heads=8, n_kv_heads=4, ffn_hidden=args.hidden * 8 // 3 // 64 * 64 + 64)


def _random_init(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0, 0.02)


def _policy_part(cfg: ModelConfig, layout: str, rank: int) -> tuple[torch.nn.Module, dict | None]:
    """This rank's part of the policy, built on meta and allocated after cutting; the pipeline's
    stage map for pp."""
    with torch.device("meta"):
        model = build_model(cfg)
    stages = None
    if layout == "tp":
        apply_tensor_parallel(model, cfg, init_device_mesh("cpu", (2,)), hook_gradients=False)
    else:
        stage_layers = split_layers(cfg, 2)
        prune_to_stages(model, stage_layers, stages_of_rank(rank, 2, 1, "1F1B"))
        stages = {"stage_layers": stage_layers, "owner": {0: 0, 1: 1}}
    materialise(model, "cpu")
    _random_init(model)
    return model.eval(), stages


def _worker(rank: int, port: int, args: argparse.Namespace, layout: str, variant: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    try:
        cfg = _config(args)
        baseline = start_measuring()
        policy, stages = _policy_part(cfg, layout, rank)
        prompts = [torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(args.prompts)]
        if variant == "shards":
            reference = copy.deepcopy(policy)  # cut and sharded like the policy
            if stages is not None:
                sampler = PipelinedInference(policy, stages["stage_layers"], stages["owner"], dist.group.WORLD)
                scorer = PipelinedInference(reference, stages["stage_layers"], stages["owner"], dist.group.WORLD)
            else:
                sampler, scorer = policy, reference

            def all_finished(done: bool) -> bool:
                flag = torch.tensor([int(done)])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                return bool(flag.item())
        else:  # a whole copy of the policy to sample from, and a whole reference
            state = full_state_dict(policy, dist.group.WORLD if stages is not None else None)
            sampler = build_model(cfg).eval()
            sampler.load_state_dict(state)
            del state
            scorer = copy.deepcopy(sampler)
            all_finished = None

        def score(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if isinstance(scorer, PipelinedInference):
                return scorer.token_values(tokens, None, None, lambda logits: token_logps(logits, labels))
            return token_logps(scorer(tokens), labels)

        out_ = generate(sampler, prompts, args.new_tokens, temperature=1.0,
                        generator=torch.Generator().manual_seed(0), all_finished=all_finished)
        with torch.no_grad():
            score(out_.sequences[:, :-1], out_.sequences[:, 1:])
        held = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in policy.parameters())
        Path(out, f"{layout}_{variant}_{rank}.json").write_text(json.dumps(
            {"peak_mib": peak_mib() - baseline, "policy_part_mib": held / 2**20}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    whole = sum(p.numel() for p in build_model(_config(args)).parameters()) * 4 / 2**20
    print(f"DeepSeek LLM, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {whole:.0f} MiB "
          f"of fp32 weights; {args.prompts} prompts x {args.new_tokens} new tokens; 2 gloo processes")
    print(f"\n{'layout':<8}{'sampling from':<16}{'rank':>5}{'policy part MiB':>17}{'peak above start MiB':>22}")
    ratios = {}
    with tempfile.TemporaryDirectory() as out:
        for layout in ("tp", "pp"):
            peaks = {}
            for variant in ("whole copy", "shards"):
                key = variant.replace(" ", "_")
                mp.start_processes(_worker, args=(free_port(), args, layout, key, out), nprocs=2, join=True,
                                   start_method="spawn")
                for rank in range(2):
                    r = json.loads(Path(out, f"{layout}_{key}_{rank}.json").read_text())
                    print(f"{layout + '=2':<8}{variant:<16}{rank:>5}{r['policy_part_mib']:>17.1f}{r['peak_mib']:>22.1f}")
                peaks[variant] = max(json.loads(Path(out, f"{layout}_{key}_{r}.json").read_text())["peak_mib"]
                                     for r in range(2))
            ratios[layout] = peaks["whole copy"] / peaks["shards"]
    for layout, ratio in ratios.items():
        headline(f"RL sampling peak memory per rank, whole copy / shards, {layout}=2", ratio, "x", "> 1")


if __name__ == "__main__":
    main()
