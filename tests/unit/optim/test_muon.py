"""Muon (``optim=muon``): torch.optim.Muon's update for the hidden matrices, AdamW for the rest, bit
for bit in one process; each routed expert orthogonalised on its own; ZeRO-1 (whole parameters per
owner), expert-parallel stacks and tensor-parallel matrices on real gloo process groups giving the
one-process update; its state in layout-independent checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from data_contract.errors import ConfigError
from dsl_lit.config.optim import OPTIMIZER_NAMES, OptimConfig
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.optim import build_optimizer
from dsl_lit.optim.build import OPTIMIZERS
from dsl_lit.optim.clip import clip_grad_norm_
from dsl_lit.optim.muon import Muon, lr_ratio, newton_schulz, orthogonalised
from dsl_lit.parallel.expert_parallel import apply_expert_parallel, expert_parameters
from dsl_lit.parallel.optimizer_state import load_named_optimizer_state, named_optimizer_state
from dsl_lit.parallel.step_runner import ZERO1_FORMS
from dsl_lit.parallel.zero1_muon import ZeRO1Muon, owners
from tests.e2e.parallel.test_expert_parallel import _cfg as tiny_v3
from tests.ranks import spawn

MUON = OptimConfig(name="muon", lr=2e-2, weight_decay=0.1)
def stack_atol(shape: tuple[int, ...], lr: float, steps: int) -> float:
    """How far a stack's batched bf16 products may take a matrix from Muon on it alone (a CPU's
    kernel may block a batch differently from one matrix, or from a smaller batch): one bf16
    rounding per Newton-Schulz iteration (5) of the update's entries (< 1.2 after it), times the
    step, per step. Orthogonalising the stack as one matrix instead would be off by ~50%."""
    return steps * 5 * 1.2 * 2**-8 * lr * lr_ratio(shape, "match_rms_adamw")


def _dense() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("deepseek_llm_tiny", vocab_size=64, n_layers=2, d_model=32,
                                             n_heads=4, n_kv_heads=2, ffn_hidden=48))


def _backward(model: torch.nn.Module, seed: int) -> None:
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def test_every_optimizer_name_has_an_optimizer_and_a_zero1_form():
    assert set(OPTIMIZER_NAMES) == set(OPTIMIZERS) == set(ZERO1_FORMS)


def test_one_process_is_torch_muon_for_the_matrices_and_adamw_for_the_rest_bit_for_bit():
    ours, reference = _dense(), _dense()
    optimizer = build_optimizer(ours, MUON)
    assert isinstance(optimizer, Muon)
    muon_group, decay, no_decay = optimizer.param_groups
    names = {id(p): n for n, p in ours.named_parameters()}
    assert muon_group["muon"] and sorted(names[id(p)] for p in decay["params"]) == ["output.weight", "tok_embeddings.weight"]
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in muon_group["params"]) and len(muon_group["params"]) == 2 * 7
    by_name = dict(reference.named_parameters())
    matrices = [by_name[names[id(p)]] for p in muon_group["params"]]
    chosen = {id(p) for p in matrices}
    torch_muon = torch.optim.Muon(matrices, lr=MUON.lr, weight_decay=MUON.weight_decay, momentum=0.95, nesterov=True,
                                  adjust_lr_fn="match_rms_adamw")
    torch_adamw = torch.optim.AdamW(
        [{"params": [p for p in reference.parameters() if id(p) not in chosen and p.ndim == 2]},
         {"params": [p for p in reference.parameters() if p.ndim == 1], "weight_decay": 0.0}],
        lr=MUON.lr, betas=tuple(MUON.betas), eps=MUON.eps, weight_decay=MUON.weight_decay)
    for step in range(3):
        for model in (ours, reference):
            _backward(model, step)
        optimizer.step()
        torch_muon.step()
        torch_adamw.step()
        optimizer.zero_grad()
        torch_muon.zero_grad()
        torch_adamw.zero_grad()
        for name, p in ours.named_parameters():
            assert torch.equal(p, by_name[name]), (step, name)
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], torch_muon.state[q]["momentum_buffer"])
               for p, q in zip(muon_group["params"], matrices))


def test_a_stack_of_expert_matrices_is_orthogonalised_expert_by_expert():
    """[experts, rows, cols]: each expert's update is Muon's for that matrix alone (wide and tall)."""
    torch.manual_seed(0)
    for shape in ((4, 24, 16), (4, 16, 24)):
        stack = torch.nn.Parameter(torch.randn(shape))
        alone = [torch.nn.Parameter(stack[e].detach().clone()) for e in range(shape[0])]
        ours = Muon([{"params": [stack], "weight_decay": 0.1, "muon": True}], lr=1e-2)
        reference = torch.optim.Muon(alone, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        for _ in range(2):
            grad = torch.randn(shape)
            stack.grad = grad.clone()
            for e, p in enumerate(alone):
                p.grad = grad[e].clone()
            ours.step()
            reference.step()
        for e, p in enumerate(alone):
            torch.testing.assert_close(stack[e].detach(), p.detach(), rtol=0, atol=stack_atol(shape, 1e-2, steps=2))


def test_newton_schulz_pushes_singular_values_towards_one():
    matrix = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(-1, 1, 32))
    before = torch.linalg.svdvals(matrix)
    singular = torch.linalg.svdvals(newton_schulz(matrix).float())
    assert before.max() / before.min() > 100
    # Muon's quintic overshoots on purpose: 5 steps bring a 150x spread to ~0.68-1.2
    assert singular.min() > 0.6 and singular.max() < 1.25


def test_bad_muon_settings_name_the_field():
    for overrides, field in ((dict(name="sgd"), "optim.name"), (dict(name="muon", ns_steps=0), "optim.ns_steps"),
                             (dict(name="muon", momentum=1.0), "optim.momentum"),
                             (dict(name="muon", lr_adjust="spectral"), "optim.lr_adjust"),
                             (dict(name="muon", fused=True), "optim.fused")):
        with pytest.raises(ConfigError, match=f"^{field}"):
            OptimConfig(**overrides).validate()


def test_owners_balance_whole_parameters():
    params = [torch.empty(n) for n in (100, 10, 60, 50, 40, 5)]
    # largest first, to the least loaded: 100 | 60, 50 (110) | 40 (140) | 10 (120) | 5 (125)
    assert owners(params, 2) == [0, 1, 1, 1, 0, 1]
    assert owners(params, 3) == [0, 1, 1, 2, 2, 1]  # 100 | 60 + 10 + 5 | 50 + 40


def _zero1_matches_muon(rank: int, world: int) -> None:
    """ZeRO1Muon on the dp-mean gradient == Muon on the same gradient, every step, bit for bit;
    each rank holds the state of the parameters it owns; the owners' named states together are
    the plain optimizer's and load into it."""
    reference, ours = _dense(), _dense()
    ref_opt = build_optimizer(reference, MUON)
    groups = OPTIMIZERS["muon"].groups(ours, MUON.weight_decay)
    opt = ZeRO1Muon(groups, group=dist.group.WORLD, **OPTIMIZERS["muon"].arguments(MUON, True))
    for step in range(3):
        _backward(ours, 10 * step + rank)
        for p, q in zip(ours.parameters(), reference.parameters()):
            dist.all_reduce(p.grad)
            p.grad /= world
            q.grad = p.grad.clone()
        assert clip_grad_norm_(ours.parameters(), 0.5) == clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), (rank, step, name)
    owned = [p for p in ours.parameters() if opt.owner_of[id(p)] == rank]
    assert {id(p) for p in opt.state} == {id(p) for p in owned}
    held = torch.tensor([sum(t.numel() for s in opt.state.values() for t in s.values() if t.ndim)])
    total = sum(t.numel() for s in ref_opt.state.values() for t in s.values() if t.ndim)
    dist.all_reduce(held)
    assert held.item() == total
    pieces: list[dict] = [{}] * world
    dist.all_gather_object(pieces, named_optimizer_state(opt, ours)["state"])
    merged = {name: state for piece in pieces for name, state in piece.items()}
    expected = named_optimizer_state(ref_opt, reference)
    assert merged.keys() == expected["state"].keys()
    for name, state in expected["state"].items():
        assert state.keys() == merged[name].keys(), name
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(merged[name][k])) for k, v in state.items()), name
    # the owners' state loads into a plain Muon and a ZeRO-1 Muon alike: the next steps agree
    fresh_model = copy.deepcopy(reference)
    fresh = build_optimizer(fresh_model, MUON)
    load_named_optimizer_state(fresh, fresh_model, {"state": merged, "param_groups": expected["param_groups"]})
    again = ZeRO1Muon(OPTIMIZERS["muon"].groups(ours, MUON.weight_decay), group=dist.group.WORLD,
                      **OPTIMIZERS["muon"].arguments(MUON, True))
    load_named_optimizer_state(again, ours, expected)
    _backward(fresh_model, 99)
    for p, q in zip(ours.parameters(), fresh_model.parameters()):
        p.grad = q.grad.clone()
    fresh.step()
    again.step()
    for p, q in zip(ours.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)


def _sharded_matrices_match_one_process(rank: int, world: int) -> None:
    """Expert-parallel stacks (sharded over experts: whole matrices, local Newton-Schulz) and
    tensor-parallel matrices (rows or columns cut: gathered, orthogonalised whole, sliced back)
    take the one-process Muon step."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    cfg = tiny_v3()
    torch.manual_seed(0)
    reference = build_model(cfg)
    ours = copy.deepcopy(reference)
    apply_expert_parallel(ours, mesh)
    experts = {id(p) for p in expert_parameters(ours)}
    assert experts
    ref_opt, opt = build_optimizer(reference, MUON), build_optimizer(ours, MUON)
    by_name = dict(reference.named_parameters())
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        for name, p in ours.named_parameters():
            grad = torch.randn(by_name[name].shape, generator=generator)
            by_name[name].grad = grad
            p.grad = distribute_tensor(grad, mesh, p.placements, src_data_rank=None) if id(p) in experts else grad.clone()
        opt.step()
        ref_opt.step()
        for name, p in ours.named_parameters():
            if id(p) in experts:  # half the stack per rank, batched as such (stack_atol)
                torch.testing.assert_close(p.full_tensor(), by_name[name], rtol=0, atol=stack_atol(p.shape, MUON.lr, step + 1),
                                           msg=f"{rank} {step} {name}")
            else:
                assert torch.equal(p, by_name[name]), (rank, step, name)
    # tensor parallel: a matrix cut by rows or columns is orthogonalised whole
    update = torch.randn(32, 48, generator=torch.Generator().manual_seed(7))
    whole = newton_schulz(update).float()
    for dim in (0, 1):
        sharded = distribute_tensor(update, mesh, [Shard(dim)], src_data_rank=None)
        got = orthogonalised(sharded, 5, (3.4445, -4.7750, 2.0315), 1e-7)
        assert isinstance(got, DTensor) and got.placements == (Shard(dim),)
        assert torch.equal(got.full_tensor(), whole)


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        _zero1_matches_muon(rank, world)
        if world == 2:
            _sharded_matrices_match_one_process(rank, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_zero1_expert_and_tensor_parallel_muon_match_one_process(tmp_path, world):
    spawn(_worker, args=(world, str(tmp_path / "init")), nprocs=world)


@pytest.mark.slow
def test_pretrain_recipe_trains_with_zero1_muon_and_resumes_its_state_in_one_process(tmp_path):
    """``optim=muon parallel=zero1`` on 2 gloo ranks, checkpoint at step 2, resumed by one process:
    the continuation's losses are the 2-rank run's, and at step 4 both hold the same momentum
    (a momentum lost on resume would restart from the step-2 gradient alone)."""
    from dsl_lit.checkpoint.sharded import read_full_tensors
    from tests.recipe_runs import losses, run_recipe

    common = ["optim=muon", "optim.lr=3e-3", "trainer.max_steps=4", "logger=csv", "checkpoint.every_n_steps=2",
              "checkpoint.every_minutes=0", "data.micro_batch_size=2"]
    dp2, single = tmp_path / "dp2_zero1", tmp_path / "single"
    run_recipe(dp2, *common, "trainer.devices=2", "parallel=zero1")
    run_recipe(single, *common, "trainer.devices=1", f"checkpoint.resume_from={dp2 / 'checkpoints' / 'step-2'}")
    sharded, resumed = losses(dp2), losses(single)
    assert sorted(sharded) == [0, 1, 2, 3] and sorted(resumed) == [2, 3]
    for step in (2, 3):  # as across layouts (tests/e2e/parallel/test_parallel_e2e.py): reordered sums, near-tied routes
        assert float(resumed[step]) == pytest.approx(float(sharded[step]), rel=2e-3), step
    states = [read_full_tensors(dp2 / "checkpoints" / step / "shards", "optimizer_states/0/state/")
              for step in ("step-2", "step-4")]
    resumed_state = read_full_tensors(single / "checkpoints" / "step-4" / "shards", "optimizer_states/0/state/")
    momenta = sorted(k for k in states[1] if k.endswith("/momentum_buffer"))
    assert momenta and momenta == sorted(k for k in resumed_state if k.endswith("/momentum_buffer"))
    assert any(".experts.w1/" in k for k in momenta) and not any("tok_embeddings" in k for k in momenta)
    at_2, at_4, resumed_4 = (torch.cat([s[k].flatten() for k in momenta]) for s in (*states, resumed_state))
    # the two step-4 momenta differ by the runs' reordered sums (measured: 3% of its norm); the
    # step-2 momentum's share of it, which a resume that lost it would lack, is 0.95^2 m_2 (39%)
    difference = float((resumed_4 - at_4).norm() / at_4.norm())
    share = float((0.95**2 * at_2).norm() / at_4.norm())
    assert difference < share / 4, (difference, share)
