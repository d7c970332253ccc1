"""Tensor-parallel plans on a real 2-rank gloo mesh: sharded models give the single-device logits,
losses and gradients for both families (MLA with and without query compression, MoE, MTP), and
the vocab-parallel cross-entropy never needs the gathered logits."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.ops import cross_entropy
from dsl_lit.parallel.tensor_parallel import apply_tensor_parallel

CONFIGS = [
    ("deepseek_llm_tiny", dict(n_layers=2, vocab_size=256)),
    ("deepseek_v3_tiny", dict(n_layers=3, vocab_size=256, seq_balance_alpha=0.0)),
    ("deepseek_v3_tiny", dict(n_layers=3, vocab_size=256, q_lora_rank=None, seq_balance_alpha=0.0)),
]


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    hidden = model.hidden_states(inputs)
    loss = cross_entropy(model.head(hidden), labels)
    for k, logits in enumerate(model.mtp_logits(hidden, inputs), start=1):
        loss = loss + cross_entropy(logits, labels[:, k:])
    return loss


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for name, overrides in CONFIGS:
            cfg = ModelConfig.from_name(name, **overrides)
            torch.manual_seed(0)
            reference = build_model(cfg)
            torch.manual_seed(0)
            sharded = apply_tensor_parallel(build_model(cfg), cfg, mesh)
            assert isinstance(sharded.layers["1"].attention.wo.weight, DTensor)
            tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
            expected = _loss(reference, tokens)
            expected.backward()
            with loss_parallel():
                logits = sharded(tokens[:, :-1])
                assert isinstance(logits, DTensor) and logits.placements[0].is_shard(dim=logits.ndim - 1)
                assert logits.to_local().shape[-1] == cfg.vocab_size // world  # never gathered
                loss = _loss(sharded, tokens)
                loss.backward()
            torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
            grads = dict(reference.named_parameters())
            for param_name, p in sharded.named_parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                torch.testing.assert_close(grad, grads[param_name].grad, atol=1e-4, rtol=1e-3,
                                           msg=lambda m, n=name, pn=param_name: f"{n} {pn}: {m}")
        # the op itself: vocab-parallel loss and gradient equal the plain ones, with ignore_index
        full = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        targets = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(3))
        targets[0, 0] = -100
        plain = cross_entropy(full, targets)
        plain.backward()
        logits = distribute_tensor(full.detach(), mesh, [Shard(-1)]).requires_grad_()
        with loss_parallel():
            loss = cross_entropy(logits, targets)
            loss.backward()
        assert not isinstance(loss, DTensor)
        torch.testing.assert_close(loss, plain)
        torch.testing.assert_close(logits.grad.full_tensor(), full.grad)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_matches_one_device(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)
