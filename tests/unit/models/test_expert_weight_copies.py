"""``precision.expert_weight_copies``: the routed experts' bf16 weight copies are cast once per weight
update (not per micro-batch, recompute replay or generated token), and training with them is bit for
bit training without them, eager and with compiled blocks (whose graphs cannot check the copies'
freshness themselves)."""

from __future__ import annotations

import pytest
import torch

from dsl_lit.config.optim import OptimConfig
from dsl_lit.inference.generation import generate
from dsl_lit.memory.recompute import apply_recompute
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.moe import GroupedExperts
from dsl_lit.optim import build_optimizer
from dsl_lit.parallel.model_transforms import TransformPlan, compile_blocks, transform_model
from dsl_lit.precision.weight_copies import keep_expert_weight_copies, weight_casts

STEPS, MICRO_BATCHES = 3, 2


def _pair(backend: str = "split", **overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("deepseek_v3_tiny", n_layers=3, mtp_depth=0, expert_backend=backend, **overrides)
    plain = build_model(cfg)
    copied = build_model(cfg)
    copied.load_state_dict(plain.state_dict())
    assert keep_expert_weight_copies(copied) == cfg.n_layers - cfg.n_dense_layers
    return cfg, plain, copied


def _train(model, cfg, compiled: bool = False) -> list[torch.Tensor]:
    """STEPS steps of the recipes' optimizer (``optim`` defaults: torch's fused AdamW kernel, which
    does not move the weights' version counters itself) of MICRO_BATCHES micro-batches each under
    bf16 autocast; the losses."""
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2).validate())
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        for _ in range(MICRO_BATCHES):
            tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _same_training(plain, copied, cfg) -> None:
    losses, copied_losses = _train(plain, cfg), _train(copied, cfg)
    assert all(torch.equal(a, b) for a, b in zip(losses, copied_losses)), (losses, copied_losses)
    for (name, a), b in zip(plain.named_parameters(), copied.parameters()):
        assert torch.equal(a, b), name  # the same gradients, steps after steps


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_copies_train_bit_for_bit_and_cast_once_per_step(recompute):
    cfg, plain, copied = _pair()
    if recompute:
        for model in (plain, copied):
            apply_recompute(model, "full")
    _same_training(plain, copied, cfg)
    owners = cfg.n_layers - cfg.n_dense_layers
    # 3 stacks per MoE layer, recast once per optimizer step (the first step's first forward makes them):
    # without copies each micro-batch's forward (and recompute's replay) casts them again
    assert weight_casts(copied) == 3 * owners * STEPS


def test_compiled_blocks_use_fresh_copies():
    """A compiled block cannot check the copies' versions: the model's forward refreshes them before
    its blocks run, so a step's update reaches the next step's compiled forward (grouped GEMM)."""
    torch._dynamo.reset()
    cfg, plain, copied = _pair(backend="grouped_mm")
    for model in (plain, copied):
        compile_blocks(model, backend="aot_eager")
    _same_training(plain, copied, cfg)
    assert weight_casts(copied) == 3 * (cfg.n_layers - cfg.n_dense_layers) * STEPS


def test_generation_casts_once_and_its_copies_serve_training():
    """Sampling (inference mode, KV cache) casts the experts once, not once per token; copies first
    made under inference mode are ordinary tensors that a training forward can save for backward."""
    cfg, plain, copied = _pair()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(copied, [[1, 2, 3], [4, 5]], max_new_tokens=6)
        ref = generate(plain, [[1, 2, 3], [4, 5]], max_new_tokens=6)
    assert [list(map(int, s)) for s in out.sequences] == [list(map(int, s)) for s in ref.sequences]
    owners = cfg.n_layers - cfg.n_dense_layers
    assert weight_casts(copied) == 3 * owners
    _same_training(plain, copied, cfg)


def test_off_without_autocast_for_fp8_and_when_asked():
    cfg, plain, copied = _pair()
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.equal(copied(tokens), plain(tokens))  # fp32: nothing to copy
    assert weight_casts(copied) == 0
    model = build_model(cfg)
    transform_model(model, TransformPlan(expert_weight_copies=False))
    assert all(m.compute_copies is None for m in model.modules() if isinstance(m, GroupedExperts))
    model = build_model(ModelConfig.from_name("deepseek_v3_tiny", d_model=128, moe_ffn_hidden=128, n_layers=2))
    transform_model(model, TransformPlan(fp8="fp8_rowwise", expert_weight_copies=True))
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.compute_copies is None for m in experts)  # FP8's own experts
