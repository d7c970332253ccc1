"""Sampling from the training layout's shards (issue 20, item 4): on 2 gloo processes the KV-cache
generator runs on a tensor-parallel DeepSeek LLM (vocab-sharded head, heads split), on an
expert-parallel DeepSeek-V3 (each rank its own prompts, experts split, all-to-all in every forward)
and on a DeepSeek-V3 cut into DualPipeV's 4 pipeline stages (rank 0 holds the first and the last,
rank 1 the middle two: hidden states go there and back every step, each rank caches its layers'
keys) or into Interleaved1F1B's (round robin), and draws the completions one process draws from the whole model with the same seed, while
each rank holds its shards only instead of a whole copy. The pipeline's frozen log-probs equal
one process's too. On 4 processes, pipeline stages whose layers are tensor- or expert-parallel
draw one process's completions as well."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dsl_lit.inference.generation import generate, positions_from_mask
from dsl_lit.models import build_model
from dsl_lit.models.common.routing_replay import (
    install_routes,
    named_stack_routers,
    recording_routes,
    remove_routes,
)
from dsl_lit.parallel.expert_parallel import apply_expert_parallel
from dsl_lit.parallel.pipeline import prune_to_stages, split_layers, stages_of_rank
from dsl_lit.parallel.pipeline_inference import PipelinedInference
from dsl_lit.parallel.tensor_parallel import apply_tensor_parallel
from dsl_lit.posttrain.logps import token_logps
from tests.numerics import EPS32
from tests.ranks import free_port, spawn
from tests.unit.posttrain.test_routing_replay import redraw_biases
from tests.unit.training.test_pretrain_module import _llm, _v3

NEW_TOKENS = 12
EOS = list(range(6, 50))  # a third of the vocabulary ends a sequence: they end early, at different steps


def _prompts(rank: int) -> list[list[int]]:
    """Rank 0's 2 prompts and rank 1's 6 (expert parallelism: batches of any size meet in the all-to-all)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(6, 128, (int(n),), generator=generator).tolist() for n in [(3, 7), (5, 4, 6, 2, 8, 3)][rank]]


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = {"llm": _llm(), "v3": _v3(mtp_depth=0), "v3_deep": _v3(n_layers=4, mtp_depth=1)}[family]
    return build_model(cfg).eval()


def _sample_and_score(model, prompts: list[list[int]]) -> dict:
    """Completions, their log-probs and the generator afterwards; then frozen log-probs of the
    generated rows (what GRPO's reference and old policy give)."""
    generator = torch.Generator().manual_seed(7)
    out = generate(model, prompts, NEW_TOKENS, temperature=1.0, eos_token_id=EOS, generator=generator)
    tokens = out.sequences[:, :-1]
    labels = out.sequences[:, 1:]
    mask = out.attention_mask[:, :-1]
    positions = mask.long().cumsum(-1).sub(1).clamp(min=0)
    with torch.no_grad():
        if isinstance(model, PipelinedInference):
            scored = model.token_values(tokens, positions, mask, lambda logits: token_logps(logits, labels))
        else:
            scored = token_logps(model(tokens, positions, mask), labels)
    return {"completions": out.completions, "logprobs": out.logprobs, "generator": generator.get_state(),
            "scored": scored}


def _sample(model: torch.nn.Module, prompts: list[list[int]], all_finished=None) -> list[list[int]]:
    out = generate(model, prompts, NEW_TOKENS, temperature=1.0, eos_token_id=EOS,
                   generator=torch.Generator().manual_seed(7), all_finished=all_finished)
    return out.completions


def _replay_after_redraw(model: torch.nn.Module, prompts: list[list[int]], all_finished=None) -> dict:
    """Rollout routing replay (R3): sample recording each token's experts, redraw the routers'
    balancing biases (so the training forward's own routing differs), score the rows replaying the
    recorded experts: the routes, the flips and the replayed log-probs."""
    with recording_routes(model, len(prompts)) as recorded:
        out = generate(model, prompts, NEW_TOKENS, temperature=1.0, eos_token_id=EOS,
                       generator=torch.Generator().manual_seed(7), all_finished=all_finished)
    redraw_biases(model)
    mask = out.attention_mask[:, :-1]
    tapes = install_routes(model, recorded[0], enforce=True)
    tokens, labels, positions = out.sequences[:, :-1], out.sequences[:, 1:], positions_from_mask(mask)
    with torch.no_grad():
        if isinstance(model, PipelinedInference):  # GRPO's old-policy log-probs through the stages
            scored = model.token_values(tokens, positions, mask, lambda logits: token_logps(logits, labels))
        else:
            scored = token_logps(model(tokens, positions, mask), labels)
    remove_routes(model)
    names = [name for name, _ in named_stack_routers(model)]
    return {"routes": recorded[0], "flips": {name: int(t.flipped) for name, t in zip(names, tapes)}, "replayed": scored,
            "logprobs": out.logprobs, "completion": out.completion_mask}


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
        results["ep_replay"] = _replay_after_redraw(ep, _prompts(rank), all_finished)
        results["ep_bytes"] = (_bytes(ep), whole_bytes)
        # pipeline: DualPipeV's V over 2 ranks, 4 stages of one layer (the last with the MTP module)
        deep = _model("v3_deep")
        whole_bytes = _bytes(deep)
        stage_layers = split_layers(deep.config, 4)
        owner = {s: r for r in range(world) for s in stages_of_rank(r, world, 2, "DualPipeV")}
        prune_to_stages(deep, stage_layers, stages_of_rank(rank, world, 2, "DualPipeV"))
        view = PipelinedInference(deep, stage_layers, owner, dist.group.WORLD)
        results["pp"] = _sample_and_score(view, _prompts(1))
        results["pp_bytes"] = (_bytes(deep), whole_bytes)
        # routing replay: each rank's routers record the sampler's routes and replay them
        routed = _model("v3_deep")
        prune_to_stages(routed, stage_layers, stages_of_rank(rank, world, 2, "DualPipeV"))
        results["pp_replay"] = _replay_after_redraw(PipelinedInference(routed, stage_layers, owner, dist.group.WORLD),
                                                    _prompts(1))
        with pytest.raises(ValueError, match="needs generator"):  # only the last stage would draw
            generate(view, _prompts(1), 2, temperature=1.0)
        # Interleaved1F1B's round robin: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
        looped = _model("v3_deep")
        owner = {s: r for r in range(world) for s in stages_of_rank(r, world, 2, "Interleaved1F1B")}
        prune_to_stages(looped, stage_layers, stages_of_rank(rank, world, 2, "Interleaved1F1B"))
        results["pp_interleaved"] = _sample_and_score(PipelinedInference(looped, stage_layers, owner, dist.group.WORLD),
                                                      _prompts(1))
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sampling_from_tensor_expert_and_pipeline_parallel_shards_draws_what_one_process_draws(tmp_path):
    spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    torch.set_num_threads(1)
    expected_tp = _sample(_model("llm"), _prompts(0))
    assert ranks[0]["tp"] == ranks[1]["tp"] == expected_tp
    assert any(c[-1] in EOS and len(c) < NEW_TOKENS for c in expected_tp)  # some stopped early
    for rank in range(2):
        assert ranks[rank]["ep"] == _sample(_model("v3"), _prompts(rank)), rank
        # routing replay under expert parallelism: the sampler's routes are one process's, and the
        # training forward (another routing: redrawn biases) replays them through the all-to-all
        # (the rank done first kept decoding pads with the other: the positions one process decoded)
        got, expected = ranks[rank]["ep_replay"], _replay_after_redraw(_model("v3"), _prompts(rank))
        n = expected["routes"].shape[1]
        assert torch.equal(got["routes"][:, :n], expected["routes"]), rank
        assert min(got["flips"].values()) > 0 and min(expected["flips"].values()) > 0
        torch.testing.assert_close(got["replayed"][:, :n], expected["replayed"], rtol=0, atol=64 * 5 * EPS32)
        done = got["completion"]  # and they are the sampler's own log-probs
        torch.testing.assert_close(got["replayed"][:, -done.shape[1]:][done], got["logprobs"][done], rtol=0,
                                   atol=64 * 5 * EPS32)
    # one rank was done before the other and kept stepping with it (the forwards are collectives)
    steps = [max(map(len, ranks[rank]["ep"])) for rank in range(2)]
    assert steps[0] != steps[1] and min(steps) < NEW_TOKENS, steps
    # each rank holds its shards, not a whole copy: tp=2 halves the attention, MLP, embedding and
    # head matrices (norms stay whole); ep=2 halves the routed experts
    sharded, whole = ranks[0]["tp_bytes"]
    assert 0.5 * whole < sharded < 0.52 * whole, (sharded, whole)
    sharded, whole = ranks[0]["ep_bytes"]
    assert sharded < 0.85 * whole, (sharded, whole)
    # pipeline stages: the tokens, their log-probs and the generator's state afterwards on both
    # ranks are one process's; the frozen log-probs equal within fp32 reordering of the head's
    # log-softmax (values ~ -5: 64 ulps of 5)
    expected = _sample_and_score(_model("v3_deep"), _prompts(1))
    for rank, placement in [(r, p) for r in range(2) for p in ("pp", "pp_interleaved")]:
        got = ranks[rank][placement]
        assert got["completions"] == expected["completions"], (rank, placement)
        assert torch.equal(got["generator"], expected["generator"]), rank
        torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=0, atol=64 * 5 * EPS32)
        torch.testing.assert_close(got["scored"], expected["scored"], rtol=0, atol=64 * 5 * EPS32)
    assert len({len(c) for c in expected["completions"]}) > 1  # sequences ended at different steps
    # routing replay through the stages: each rank recorded its routers' share of one process's
    # routes, counted the same flips, and the replayed log-probs are one process's
    expected = _replay_after_redraw(_model("v3_deep"), _prompts(1))
    names = list(expected["flips"])
    for rank in range(2):
        got = ranks[rank]["pp_replay"]
        assert got["flips"] == {name: expected["flips"][name] for name in got["flips"]}, rank
        columns = [names.index(name) for name in got["flips"]]
        assert torch.equal(got["routes"], expected["routes"][:, :, columns]), rank
        torch.testing.assert_close(got["replayed"], expected["replayed"], rtol=0, atol=64 * 5 * EPS32)
    assert sorted({*ranks[0]["pp_replay"]["flips"], *ranks[1]["pp_replay"]["flips"]}) == sorted(names)
    assert min(expected["flips"].values()) > 0
    sharded, whole = ranks[0]["pp_bytes"]  # rank 0: stages 0 and 3 (embedding, a layer, head, MTP)
    assert sharded < 0.8 * whole, (sharded, whole)
    sharded_1, _ = ranks[1]["pp_bytes"]  # rank 1: stages 1 and 2 (two layers)
    assert sharded + sharded_1 == whole, (sharded, sharded_1, whole)


def _pipelined_worker(rank: int, port: int, out: str, inner: str) -> None:
    """4 ranks: 2 pipeline stages, each on 2 tensor- (DeepSeek LLM) or expert-parallel (V3) ranks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="4", RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", inner))
        model = _model("llm" if inner == "tp" else "v3_deep")
        stage_layers = split_layers(model.config, 2)
        prune_to_stages(model, stage_layers, [mesh["pp"].get_local_rank()])
        if inner == "tp":
            apply_tensor_parallel(model, model.config, mesh["tp"], hook_gradients=False)
        else:
            apply_expert_parallel(model, mesh["ep"])

        def all_finished(done_here: bool) -> bool:  # the ep ranks' pipelines decode in lockstep
            flag = torch.tensor([int(done_here)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

        replica = mesh[inner].get_local_rank() if inner == "ep" else 0  # ep ranks: their own prompts
        view = PipelinedInference(model, stage_layers, {0: 0, 1: 1}, mesh["pp"].get_group())
        torch.save(_sample(view, _prompts(replica), all_finished), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["tp", "ep"])
def test_pipeline_stages_sharded_by_tensor_or_expert_parallelism_draw_what_one_process_draws(tmp_path, inner):
    spawn(_pipelined_worker, args=(free_port(), str(tmp_path), inner), nprocs=4)
    torch.set_num_threads(1)
    for rank in range(4):
        replica = rank % 2 if inner == "ep" else 0  # mesh (pp, inner): rank = 2 * pp_rank + inner rank
        expected = _sample(_model("llm" if inner == "tp" else "v3_deep"), _prompts(replica))
        assert torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) == expected, rank
