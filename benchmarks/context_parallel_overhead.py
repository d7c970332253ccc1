"""Context parallelism's step-time overhead: cp=2 against dp=2 on the same 2 gloo processes.

Both layouts give every rank the same number of tokens of the same global batch (dp: half the
rows, whole; cp: every row, half its positions), the same model and the same forward + backward
+ gradient all-reduce, so the ratio is what context parallelism adds: the all-gather of every
attention layer's key sources (MLA: the 576-wide latent; GQA: the kv heads), its backward
all-reduce, the explicit mask instead of ``is_causal`` and the sequence gathers of the routing
statistics. Timed interleaved (``benchmarks.timing``), after warm-up, medians over ``--repeats``.

    .venv/bin/python -m benchmarks.context_parallel_overhead [--seq 512 2048] [--model deepseek_v3_tiny]
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.headline import headline
from benchmarks.timing import interleaved_medians
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.ops import cross_entropy
from dsl_lit.parallel.context_parallel import ContextParallelKeys, apply_context_parallel
from dsl_lit.utils.machine import cpu_description


def _step(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, keys: ContextParallelKeys | None) -> None:
    if keys is None:
        logits = model(tokens)
    else:
        positions = keys.query_positions.expand(tokens.shape[0], -1)
        logits = model(keys.shard(tokens), positions=positions, cache=keys)
        labels = keys.shard(labels)
    cross_entropy(logits, labels).backward()
    for p in model.parameters():  # the gradient reduction both layouts make (dp x cp replicas)
        if p.grad is not None:
            dist.all_reduce(p.grad)
    model.zero_grad(set_to_none=True)


def _rank(rank: int, init_file: str, args: argparse.Namespace, results: dict) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for seq in args.seq:
            torch.manual_seed(0)
            cfg = ModelConfig.from_name(args.model, n_layers=args.layers, max_seq_len=seq, mtp_depth=0)
            dense, sharded = build_model(cfg), build_model(cfg)
            sharded.load_state_dict(dense.state_dict())
            apply_context_parallel(sharded, dist.group.WORLD)
            rows = torch.randint(0, cfg.vocab_size, (2 * args.rows, seq + 1), generator=torch.Generator().manual_seed(1))
            mine = rows[rank * args.rows : (rank + 1) * args.rows]
            keys = ContextParallelKeys(seq, dist.group.WORLD)
            medians = interleaved_medians({
                "dp2": functools.partial(_step, dense, mine[:, :-1], mine[:, 1:], None),
                "cp2": functools.partial(_step, sharded, rows[:, :-1], rows[:, 1:], keys),
            }, repeats=args.repeats, warmup=2)
            if rank == 0:
                results[seq] = medians
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek_v3_tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rows", type=int, default=2, help="rows per data-parallel rank (cp: 2x rows, half the positions)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(cpu_description())
    print(f"{args.model} ({args.layers} layers), 2 gloo processes, {2 * args.rows} rows per step")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(os.path.join(tmp, "init"), args, results), nprocs=2, join=True)
        print(f"{'seq':>6}{'dp2 ms':>10}{'cp2 ms':>10}{'cp2 / dp2':>11}")
        for seq in args.seq:
            dp, cp = results[seq]["dp2"], results[seq]["cp2"]
            print(f"{seq:>6}{dp * 1e3:>10.1f}{cp * 1e3:>10.1f}{cp / dp:>11.2f}")
            headline(f"context parallel step time cp2 / dp2 at {seq} tokens ({args.model})", cp / dp, "x")


if __name__ == "__main__":
    main()
