"""LR schedules at exact steps, AdamW parameter groups, analytical FLOPs."""

from __future__ import annotations

import math

import pytest
import torch

from data_contract.errors import ConfigError
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.flops import non_embedding_flops_per_token, training_flops_per_token
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.optim import build_lr_scheduler, build_optimizer
from dsl_lit.optim.schedules import cosine_multiplier, multi_step_multiplier, wsd_multiplier
from tests.numerics import assert_close_fp32


def test_multi_step_deepseek_values():
    f = lambda s: multi_step_multiplier(s, total_steps=10000, warmup_steps=2000)  # noqa: E731
    assert f(0) == pytest.approx(1 / 2000)
    assert f(999) == pytest.approx(0.5)
    assert f(1999) == 1.0 and f(2000) == 1.0 and f(7999) == 1.0
    assert f(8000) == 0.316 and f(8999) == 0.316
    assert f(9000) == 0.1 and f(9999) == 0.1


def test_cosine_values():
    f = lambda s: cosine_multiplier(s, total_steps=1100, warmup_steps=100, min_ratio=0.1)  # noqa: E731
    assert f(49) == pytest.approx(0.5)
    assert f(100) == pytest.approx(1.0)
    assert f(600) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert f(1100) == pytest.approx(0.1)
    assert f(350) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_wsd_values():
    f = lambda s: wsd_multiplier(s, total_steps=1000, warmup_steps=100, decay_fraction=0.2)  # noqa: E731
    assert f(99) == 1.0 and f(500) == 1.0 and f(799) == 1.0
    assert f(800) == pytest.approx(1.0)
    assert f(900) == pytest.approx(0.5)
    assert f(1000) == pytest.approx(0.0)


def test_scheduler_drives_optimizer_lr_and_round_trips():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = build_lr_scheduler(opt, ScheduleConfig(name="multi_step", warmup_steps=10), total_steps=100)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[80] == pytest.approx(3.16e-4) and lrs[90] == pytest.approx(1e-4)
    # state survives a weights_only round trip (checkpoints load this way)
    import io

    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["last_epoch"] == 100


def test_adamw_groups_skip_decay_on_norms():
    model = build_model(ModelConfig.from_name("deepseek_llm_tiny", vocab_size=256, n_layers=1))
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(no_decay["params"]) == 3  # two block norms + the final norm
    assert opt.defaults["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("field, value", [("lr", -1.0), ("lr", 0.0), ("weight_decay", -0.1), ("grad_clip", -1.0)])
def test_bad_optim_values(field, value):
    with pytest.raises(ConfigError, match=f"optim.{field}"):
        OptimConfig(**{field: value}).validate()


def test_bad_schedule_name():
    with pytest.raises(ConfigError, match="schedule.name"):
        ScheduleConfig(name="linear").validate()


def test_deepseek_model_scale_formula():
    # DeepSeek LLM 7B: 30 layers, d 4096, seq 4096 -> M = 72*30*4096^2 + 12*30*4096*4096
    assert non_embedding_flops_per_token(30, 4096, 4096) == 72 * 30 * 4096**2 + 12 * 30 * 4096**2


def test_training_flops_match_six_n_for_dense_mha():
    cfg = ModelConfig.from_name("deepseek_llm_7b")
    model_params = 30 * (4 * 4096**2 + 3 * 4096 * 11008) + 4096 * 102400
    assert training_flops_per_token(cfg, 4096) == 6 * model_params + 12 * 30 * 4096 * 4096


def test_bf16_moments_track_torch_adamw_and_stay_bf16():
    """DeepSeek-V3's bf16 AdamW moments: the update is torch's within bf16 rounding of the moments,
    the state is stored in bf16 (half the bytes) and survives a state-dict round trip."""
    from dsl_lit.optim.adamw import AdamW

    torch.manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = AdamW(ours_p, moments_dtype=torch.bfloat16, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in ours_p]
        for p, q, g in zip(ours_p, ref_p, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p, q, atol=2e-4, rtol=0)  # lr 1e-2 x bf16's 2^-8 relative rounding
        assert not torch.equal(p, q)
    state = ours.state[ours_p[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    restored = AdamW(ours_p, moments_dtype=torch.bfloat16, lr=1e-2)
    restored.load_state_dict(ours.state_dict())
    assert restored.state[ours_p[0]]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(restored.state[ours_p[0]]["exp_avg"], state["exp_avg"])


def test_fused_adamw_runs_and_matches_foreach():
    from dsl_lit.optim import build_optimizer

    torch.manual_seed(0)
    models = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [build_optimizer(models[0], OptimConfig(fused=True).validate()),
                  build_optimizer(models[1], OptimConfig(foreach=True).validate())]
    for _ in range(3):
        x = torch.randn(4, 16)
        for model, optimizer in zip(models, optimizers):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert_close_fp32(p, q, 3)  # same gradients; the kernels round each of the 3 updates differently
    with pytest.raises(ConfigError, match="optim.fused=true and optim.foreach=true exclude each other"):
        OptimConfig(fused=True, foreach=True).validate()


@pytest.mark.parametrize("config, fused", [({}, True), ({"foreach": True}, False), ({"moments_dtype": "bf16"}, False),
                                           ({"fused": False}, False)])
def test_fused_adamw_is_the_default_wherever_it_applies(config, fused):
    """``optim.fused: null`` (the default): torch's fused kernel unless foreach or bf16 moments are asked for."""
    model = torch.nn.Linear(16, 8)
    optimizer = build_optimizer(model, OptimConfig(**config).validate())
    assert all(bool(group["fused"]) == fused for group in optimizer.param_groups)


@pytest.mark.parametrize("config", [{}, {"foreach": True}, {"moments_dtype": "bf16"}, {"fused": False},
                                    {"name": "muon"}], ids=["fused", "foreach", "bf16_moments", "per_tensor", "muon"])
def test_every_optimizer_step_moves_the_version_of_what_it_updated(config):
    """Every kind of step marks the parameters it wrote as changed (their version counter moves):
    torch's fused AdamW kernel writes them without it, and the experts' bf16 copies, which recast a
    weight only when its version moved, then served the weights of step 0 to every later forward
    (found on an H200: a bf16 run resumed from its step-10 checkpoint lost 1e-3 of loss at once).
    A parameter without a gradient is not written and keeps its version."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    model[1].requires_grad_(False)  # no gradient: left alone
    optimizer = build_optimizer(model, OptimConfig(**config).validate())
    model(torch.randn(4, 16)).square().sum().backward()
    before = {name: p._version for name, p in model.named_parameters()}
    optimizer.step()
    for name, p in model.named_parameters():
        assert (p._version > before[name]) == (p.grad is not None), (name, before[name], p._version)


def test_fused_adamw_is_not_chosen_for_groups_mixing_dtensors_and_tensors(tmp_path):
    """Expert parallelism shards only the experts (DTensors): torch's fused kernel refuses a group
    mixing them with plain tensors, so the default falls back to the per-tensor loop there."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(16, 8)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (1,)), [Shard(0)]))
        mixed = torch.nn.Sequential(model, torch.nn.Linear(8, 4))  # decayed matrices: one DTensor, one tensor
        optimizer = build_optimizer(mixed, OptimConfig().validate())
        assert not any(group["fused"] for group in optimizer.param_groups)
        for p in mixed.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()  # the per-tensor loop steps the mix (the fused kernel raised here)
        # all DTensors (tensor parallelism): the fused kernel, and the local shards' versions move too
        sharded = torch.nn.Linear(16, 8, bias=False)
        sharded.weight = torch.nn.Parameter(distribute_tensor(sharded.weight.detach(), init_device_mesh("cpu", (1,)), [Shard(0)]))
        optimizer = build_optimizer(sharded, OptimConfig().validate())
        assert optimizer.param_groups[0]["fused"]
        sharded.weight.grad = torch.ones_like(sharded.weight)
        before = sharded.weight.to_local()._version
        optimizer.step()
        assert sharded.weight.to_local()._version > before
    finally:
        dist.destroy_process_group()
