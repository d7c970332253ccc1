"""ZeRO-1 on real gloo process groups (2 and 3 ranks): the same updates, norms and optimizer state
as one AdamW over the mean gradient, with 1/dp of the optimizer memory per rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dsl_lit.config.optim import OptimConfig
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.optim import build_optimizer, param_groups
from dsl_lit.optim.build import adamw_arguments
from dsl_lit.optim.clip import clip_grad_norm_
from dsl_lit.parallel.zero1 import ZeRO1AdamW
from tests.numerics import assert_close_fp32, assert_close_in_norm
from tests.ranks import spawn


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("deepseek_llm_tiny", vocab_size=64, n_layers=2, d_model=32,
                                             n_heads=4, n_kv_heads=2, ffn_hidden=48))


TOKENS = 2 * 16  # targets per rank and step: the longest sum behind a rank's gradient


def _grads(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()


def _worker(rank: int, world: int, init_file: str, bucket_numel: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
        reference, ours = _model(), _model()
        ref_opt = build_optimizer(reference, cfg)
        opt = ZeRO1AdamW(param_groups(ours, cfg.weight_decay), **adamw_arguments(cfg), bucket_numel=bucket_numel)
        total = sum(p.numel() for p in ours.parameters())
        assert opt.state_numel() == 0 + sum(b.master.numel() for b in opt.buckets)
        for step in range(3):
            data = torch.randint(0, 64, (world, 2, 17), generator=torch.Generator().manual_seed(step))
            for r in range(world):  # the reference sees every rank's data: mean of per-rank gradients
                _grads(reference, data[r])
            for p in reference.parameters():
                p.grad /= world
            ref_norm = clip_grad_norm_(reference.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
            if step == 1:  # overlapped: buckets reduce-scatter from the backward hooks
                opt.arm()
            _grads(ours, data[rank])
            if step == 1:
                assert opt.launched_in_backward == len(opt.buckets)
            norm = opt.reduce_gradients(max_norm=0.5)
            opt.step()
            opt.zero_grad()
            assert_close_fp32(norm, ref_norm, TOKENS * world, msg=f"step {step} grad norm")
            for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
                assert_close_in_norm(a, b, TOKENS * world, msg=f"step {step} {name}")
        # optimizer memory: master + two moments of 1/world of the parameters (plus padding)
        assert len(opt.buckets) > (2 if bucket_numel < total else 1)
        assert abs(opt.state_numel() - 3 * total / world) <= 3 * len(opt.buckets) * world
        # the state dict is a plain AdamW's, whatever the dp size, and loads back
        ours_sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        assert ours_sd["param_groups"] == ref_sd["param_groups"]
        for pid, ref_state in ref_sd["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):  # moments relative to their own magnitude
                assert_close_fp32(ours_sd["state"][pid][key], ref_state[key], TOKENS * world, msg=f"{pid} {key}")
        # for sharded checkpoints each rank holds the moments of the parameters it owns: each once
        owned = opt.sharded_state_dict()
        for pid, state in owned["state"].items():
            assert_close_fp32(state["exp_avg_sq"], ref_sd["state"][pid]["exp_avg_sq"], TOKENS * world, msg=str(pid))
        everyone: list = [None] * world
        dist.all_gather_object(everyone, sorted(owned["state"]))
        assert sorted(pid for ids in everyone for pid in ids) == sorted(ref_sd["state"])
        fresh_model = copy.deepcopy(reference)
        fresh = ZeRO1AdamW(param_groups(fresh_model, cfg.weight_decay), **adamw_arguments(cfg),
                           bucket_numel=bucket_numel)
        # and reads back only the moments of the parameters overlapping its shards
        needed = {fresh.param_index[id(p)] for p in fresh.params_overlapping_shard()}
        assert 0 < len(needed) < len(ref_sd["state"]) or world == 1
        fresh.load_state_dict({**ref_sd, "state": {i: v for i, v in ref_sd["state"].items() if i in needed}})
        data = torch.randint(0, 64, (world, 2, 17), generator=torch.Generator().manual_seed(9))
        for r in range(world):
            _grads(reference, data[r])
        for p in reference.parameters():
            p.grad /= world
        ref_opt.step()
        _grads(fresh_model, data[rank])
        fresh.reduce_gradients(max_norm=None)
        fresh.step()
        for (name, a), b in zip(fresh_model.named_parameters(), reference.parameters()):
            assert_close_in_norm(a, b, TOKENS * world, msg=f"resumed {name}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world", "bucket_numel"), [(2, 2**22), (3, 2**22), (2, 3000)])
def test_zero1_matches_adamw_on_the_mean_gradient(tmp_path, world, bucket_numel):
    """One bucket per parameter group, or many small ones (more buckets than ranks)."""
    spawn(_worker, args=(world, str(tmp_path / "init"), bucket_numel), nprocs=world)
