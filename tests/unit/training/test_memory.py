"""Activation recompute keeps the gradients and expert loads and saves fewer activation bytes;
the CPU EMA of the weights follows its recurrence, can be validated with and survives a checkpoint."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from data_contract.errors import ConfigError
from dsl_lit.config.memory import MemoryConfig
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.memory.recompute import apply_recompute
from dsl_lit.models import build_model
from dsl_lit.ops import cross_entropy
from dsl_lit.parallel.strategy import DeepSeekStrategy
from dsl_lit.training import PretrainModule
from dsl_lit.training.callbacks.ema import EMACallback
from tests.numerics import assert_close_fp32
from tests.unit.training.test_pretrain_module import _batch, _v3


class _CountOps(TorchDispatchMode):
    """Counts the matmuls and the RMSNorm reciprocal square roots run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = self.rsqrts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.matmuls += name in ("mm", "addmm", "bmm", "_grouped_mm")
        self.rsqrts += name == "rsqrt"
        return func(*args, **(kwargs or {}))


def _step(mode: str) -> tuple[_CountOps, dict[str, torch.Tensor], torch.Tensor]:
    """One forward + backward with ``mode`` recompute; what backward ran, the grads, the loads."""
    tokens = _batch(0, rows=4, seq=64)["input_ids"]
    torch.manual_seed(0)
    model = build_model(_v3(mtp_depth=0))
    assert apply_recompute(model, mode) == (0 if mode == "none" else 2)
    loss = cross_entropy(model(tokens), tokens) + model.balance_loss()
    with _CountOps() as backward_ops:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return backward_ops, grads, torch.stack([m.gate.load.counts for m in model.moe_layers()])


def test_recompute_keeps_gradients_and_loads_and_recomputes_what_it_says():
    base_ops, base_grads, base_loads = _step("none")
    for mode in ("selective", "full"):
        ops, grads, loads = _step(mode)
        for name, grad in base_grads.items():
            assert_close_fp32(grads[name], grad, 4 * 64, msg=f"{mode} {name}")  # rows x seq of the batch
        assert torch.equal(loads, base_loads), mode  # recomputed router forwards count nothing
        assert ops.rsqrts > base_ops.rsqrts, mode  # norms are recomputed in backward
        if mode == "selective":
            assert ops.matmuls == base_ops.matmuls  # ...but no GEMM is
        else:
            assert ops.matmuls > base_ops.matmuls  # full recompute repeats the block's GEMMs


def test_recompute_is_configurable_per_block_and_validated():
    model = build_model(_v3(n_layers=3, mtp_depth=1))
    assert apply_recompute(model, "full", blocks=[0, 2]) == 2
    assert "forward" in vars(model.layers["0"]) and "forward" not in vars(model.layers["1"])
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in build_model(_v3(n_layers=3, mtp_depth=1)).named_parameters()]
    with pytest.raises(ConfigError, match="memory.recompute='some' is unknown"):
        MemoryConfig(recompute="some").validate()
    with pytest.raises(ConfigError, match="memory.validate_with_ema=true needs an EMA"):
        MemoryConfig(validate_with_ema=True).validate()


class _Track(L.Callback):
    """Records the weights after every step (the EMA's inputs), before the EMA callback runs."""

    def __init__(self) -> None:
        self.history: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.history.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})


def _fit_with_ema(tmp_path, steps: int, ckpt_path=None, validate_with_ema=False):
    torch.manual_seed(0)
    module = PretrainModule(_v3(), OptimConfig(lr=1e-2), ScheduleConfig(name="constant", warmup_steps=0), 4,
                            total_steps=steps)
    track, ema = _Track(), EMACallback(decay=0.9, validate_with_ema=validate_with_ema)
    batches = [_batch(i) for i in range(steps)]
    trainer = L.Trainer(accelerator="cpu", strategy=DeepSeekStrategy(), max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[track, ema], default_root_dir=tmp_path,
                        enable_checkpointing=False, limit_val_batches=1 if validate_with_ema else 0,
                        val_check_interval=1 if validate_with_ema else None, num_sanity_val_steps=0,
                        check_val_every_n_epoch=None if validate_with_ema else 1)
    loaders = {"train_dataloaders": DataLoader(batches, batch_size=None)}
    if validate_with_ema:
        loaders["val_dataloaders"] = DataLoader([batches[0]], batch_size=None)
    trainer.fit(module, **loaders, ckpt_path=ckpt_path)
    return module, trainer, track, ema


def test_ema_follows_its_recurrence_and_survives_a_checkpoint(tmp_path):
    module, trainer, track, ema = _fit_with_ema(tmp_path, steps=3)
    torch.manual_seed(0)
    expected = {n: p.detach().float().clone() for n, p in build_model(_v3()).named_parameters()}
    for weights in track.history:
        for name in expected:
            expected[name] = 0.9 * expected[name] + 0.1 * weights[name]
    for name, value in expected.items():
        assert_close_fp32(ema.ema[name], value, len(track.history) + 1, msg=name)  # one rounding per step
        assert ema.ema[name].device.type == "cpu"
    path = tmp_path / "ema.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if "EMACallback" in k]
    restored = EMACallback(decay=0.9)
    restored.load_state_dict(state)
    restored.on_fit_start(trainer, module)  # (Lightning restores a checkpoint between these two hooks)
    restored.on_train_start(trainer, module)
    for name, value in ema.ema.items():
        assert torch.equal(restored.ema[name], value), name
    fresh = EMACallback(decay=0.9)  # a resumed run that had no EMA starts it from the loaded weights
    fresh.on_fit_start(trainer, module)
    fresh.on_train_start(trainer, module)
    for name, p in module.model.named_parameters():
        assert torch.equal(fresh.ema[name], p.detach()), name


def test_validation_runs_on_the_ema_and_restores_the_weights(tmp_path):
    module, trainer, track, ema = _fit_with_ema(tmp_path, steps=2, validate_with_ema=True)
    for name, p in module.model.named_parameters():  # after validation the trained weights are back
        assert torch.equal(p.detach(), track.history[-1][name]), name
    assert not torch.equal(ema.ema["output.weight"], track.history[-1]["output.weight"])
