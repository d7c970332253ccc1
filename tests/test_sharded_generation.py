"""Sampling from the training layout's shards (issue 20, item 4): on 2 gloo processes the KV-cache
generator runs on a tensor-parallel DeepSeek LLM (vocab-sharded head, heads split) and on an
expert-parallel DeepSeek-V3 (each rank its own prompts, experts split, all-to-all in every forward)
and draws the completions one process draws from the whole model with the same seed, while each
rank holds its shards only instead of a whole copy."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dsl_lit.inference.generation import generate
from dsl_lit.models import build_model
from dsl_lit.parallel.expert_parallel import apply_expert_parallel
from dsl_lit.parallel.tensor_parallel import apply_tensor_parallel
from tests.ranks import free_port, spawn
from tests.test_pretrain_module import _llm, _v3

NEW_TOKENS = 12
EOS = list(range(6, 50))  # a third of the vocabulary ends a sequence: they end early, at different steps


def _prompts(rank: int) -> list[list[int]]:
    """Rank 0's 2 prompts and rank 1's 6 (expert parallelism: batches of any size meet in the all-to-all)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(6, 128, (int(n),), generator=generator).tolist() for n in [(3, 7), (5, 4, 6, 2, 8, 3)][rank]]


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(_llm() if family == "llm" else _v3(mtp_depth=0)).eval()


def _sample(model: torch.nn.Module, prompts: list[list[int]], all_finished=None) -> list[list[int]]:
    out = generate(model, prompts, NEW_TOKENS, temperature=1.0, eos_token_id=EOS,
                   generator=torch.Generator().manual_seed(7), all_finished=all_finished)
    return out.completions


def _bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (its local shards under a sharded layout)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    # a rank that stopped decoding alone would leave the other waiting in a collective: fail, not hang
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))

    def all_finished(done_here: bool) -> bool:
        flag = torch.tensor([1 if done_here else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    try:
        results = {}
        mesh = init_device_mesh("cpu", (world,))
        tp = _model("llm")
        whole_bytes = _bytes(tp)
        apply_tensor_parallel(tp, _llm(), mesh, hook_gradients=False)
        # the ranks of a tensor-parallel group sample the same prompts with the same generator
        results["tp"] = _sample(tp, _prompts(0), all_finished)
        results["tp_bytes"] = (_bytes(tp), whole_bytes)
        ep = _model("v3")
        whole_bytes = _bytes(ep)
        apply_expert_parallel(ep, mesh)
        results["ep"] = _sample(ep, _prompts(rank), all_finished)  # expert-parallel ranks: their own prompts
        results["ep_bytes"] = (_bytes(ep), whole_bytes)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sampling_from_tensor_and_expert_parallel_shards_draws_what_one_process_draws(tmp_path):
    spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    torch.set_num_threads(1)
    expected_tp = _sample(_model("llm"), _prompts(0))
    assert ranks[0]["tp"] == ranks[1]["tp"] == expected_tp
    assert any(c[-1] in EOS and len(c) < NEW_TOKENS for c in expected_tp)  # some stopped early
    for rank in range(2):
        assert ranks[rank]["ep"] == _sample(_model("v3"), _prompts(rank)), rank
    # one rank was done before the other and kept stepping with it (the forwards are collectives)
    steps = [max(map(len, ranks[rank]["ep"])) for rank in range(2)]
    assert steps[0] != steps[1] and min(steps) < NEW_TOKENS, steps
    # each rank holds its shards, not a whole copy: tp=2 halves the attention, MLP, embedding and
    # head matrices (norms stay whole); ep=2 halves the routed experts
    sharded, whole = ranks[0]["tp_bytes"]
    assert 0.5 * whole < sharded < 0.52 * whole, (sharded, whole)
    sharded, whole = ranks[0]["ep_bytes"]
    assert sharded < 0.85 * whole, (sharded, whole)
