"""An FP8 DeepSeek-V3 checkpoint whose routed experts are torchao's: saved, resumed and exported
under the names a high-precision model's checkpoint has.

``apply_fp8(backend="torchao")`` keeps each routed expert weight (``experts.w1/w2/w3``) as torchao's
``Float8TrainingWeightWrapperTensor``, a tensor subclass around the master weight; on CPU torchao
runs those experts under ``expert_backend=split`` (torch's CPU ``_scaled_mm``). The recipes pick
torchao only on CUDA, and the GPU tests train FP8 with checkpoints off, so this file forces the
torchao backend into the recipe's own transform (``model_transforms.apply_fp8``) and trains with
the recipe's one-device strategy, checkpoint IO and precision plugin: a real ``Trainer``, in this
process, with an EMA of the weights. Checked, for a synchronous save (which failed: safetensors
cannot write torchao's wrapper) and an asynchronous one: the checkpoint holds plain fp32 tensors
under the high-precision model's names (weights, AdamW moments, EMA); a resume into a fresh FP8
model (its experts torchao's again) continues bit for bit like the uninterrupted run; the same
checkpoint resumes into a model without FP8; and the HF export (of the weights and of the EMA), like ``save_pretrained`` of the FP8 model
itself, has the keys and values a high-precision model's ``save_pretrained`` writes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from dsl_lit.checkpoint.directory import DirectoryCheckpointIO, StepCheckpoint
from dsl_lit.checkpoint.export_hf import export
from dsl_lit.checkpoint.sharded import plain_tensor, read_full_tensors
from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.config.precision import PrecisionConfig
from dsl_lit.hf.io import save_pretrained
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.parallel import model_transforms
from dsl_lit.parallel.strategy import DeepSeekStrategy
from dsl_lit.precision.fp8 import apply_fp8
from dsl_lit.precision.plugin import AutocastPrecision
from dsl_lit.training import PretrainModule
from dsl_lit.training.callbacks.ema import EMACallback

WRAPPER = "Float8TrainingWeightWrapperTensor"
STEPS = 4
EMA_DECAY = 0.5
MODEL = dict(  # tiny V3: MLA, 8 routed experts (dims multiples of 16, as FP8 needs), MTP
    name="deepseek_v3_tiny", vocab_size=128, n_layers=2, n_dense_layers=1, d_model=64, n_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, ffn_hidden=96,
    n_routed_experts=8, n_activated_experts=2, n_expert_groups=4, n_limited_groups=2, moe_ffn_hidden=32,
    mtp_depth=1, expert_backend="split",
)


@pytest.fixture(autouse=True)
def torchao_fp8_on_cpu(monkeypatch):
    """The recipe's FP8 transform with torchao's backend (on CPU ``auto`` picks the reference path);
    oneDNN off: its CPU FP8 matmul takes ~25 s a step here, torch's plain ``_scaled_mm`` ~0.1 s."""
    monkeypatch.setattr(model_transforms, "apply_fp8", functools.partial(apply_fp8, backend="torchao"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.backends.mkldnn.flags(enabled=False):
        yield
    torch.set_num_threads(threads)


def _batches() -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in range(STEPS):
        tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(seed))
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()})
    return out


class Weights(L.Callback):
    """Copies of the model's weights when training starts and ends, and the expert weights' types."""

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.start = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        self.types = {type(p).__name__ for n, p in pl_module.model.named_parameters() if ".experts.w" in n}
        self.model = pl_module.model

    def on_train_end(self, trainer, pl_module):
        self.end = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


def _fit(root: Path, fp8: bool, async_save: bool, resume: Path | None = None, steps: int = STEPS) -> Weights:
    """The recipe's one-device setup (strategy, checkpoint IO, bf16 autocast) with an EMA, saving
    every 2 steps under ``root``; a resumed run is given the batches from its step on."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name(**MODEL)
    module = PretrainModule(cfg, OptimConfig(lr=1e-2), ScheduleConfig(name="constant", warmup_steps=0),
                            micro_batch_size=4, total_steps=steps,
                            precision=PrecisionConfig(name="bf16", fp8="fp8_rowwise" if fp8 else None))
    weights = Weights()
    trainer = L.Trainer(
        accelerator="cpu", strategy=DeepSeekStrategy(), max_steps=steps, logger=False,
        callbacks=[weights, EMACallback(EMA_DECAY), StepCheckpoint(root, every_n_steps=2)], enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
        plugins=[DirectoryCheckpointIO({"model": MODEL}, async_save=async_save), AutocastPrecision("bf16", "cpu")],
    )
    first = int(resume.name.removeprefix("step-")) if resume else 0
    trainer.fit(module, train_dataloaders=DataLoader(_batches()[first:steps], batch_size=None),
                ckpt_path=str(resume) if resume else None)
    return weights


def _plain_model_keys() -> list[str]:
    return list(build_model(ModelConfig.from_name(**MODEL)).state_dict())


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def _plain_save_pretrained(state: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for a model without FP8 holding ``state``."""
    model = build_model(ModelConfig.from_name(**MODEL))
    model.load_state_dict(state, strict=True)
    return _hf_tensors(save_pretrained(model, directory))


def _assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert type(got[name]) is torch.Tensor and got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_torchao_fp8_checkpoint_saves_resumes_and_exports_under_the_plain_names(tmp_path, async_save):
    uninterrupted = _fit(tmp_path / "a", fp8=True, async_save=async_save)
    assert uninterrupted.types == {WRAPPER}  # torchao's experts really ran
    step2 = tmp_path / "a" / "step-2"

    # plain fp32 tensors under the high-precision model's names: weights, AdamW moments, EMA
    saved = read_full_tensors(step2 / "shards")
    names = _plain_model_keys()
    weights = {k.removeprefix("state_dict/model."): v for k, v in saved.items() if k.startswith("state_dict/")}
    assert sorted(weights) == sorted(names)
    (ema_prefix,) = {k[: k.index("/ema/") + 5] for k in saved if "/ema/" in k}
    experts = [n for n in names if ".experts.w" in n]
    assert len(experts) == 2 * 3  # the MoE layer and the MTP block
    for name in experts:
        for key in (f"state_dict/model.{name}", f"optimizer_states/0/state/model.{name}/exp_avg",
                    f"optimizer_states/0/state/model.{name}/exp_avg_sq", f"{ema_prefix}{name}"):
            assert type(saved[key]) is torch.Tensor and saved[key].dtype == torch.float32, key

    # a fresh FP8 model resumes step 2 and ends where the uninterrupted run ended, bit for bit
    resumed = _fit(tmp_path / "b", fp8=True, async_save=async_save, resume=step2)
    assert resumed.step == 2 and resumed.types == {WRAPPER}
    for name, value in weights.items():
        assert torch.equal(resumed.start[name], value), name
    assert not torch.equal(uninterrupted.end[experts[0]], resumed.start[experts[0]])  # the experts trained
    for name, value in uninterrupted.end.items():
        assert torch.equal(resumed.end[name], value), name
    final, final_resumed = (read_full_tensors(root / "step-4" / "shards") for root in (tmp_path / "a", tmp_path / "b"))
    _assert_same_tensors(final_resumed, final)  # weights, AdamW moments and EMA of step 4

    # the same checkpoint resumes into a model without FP8 (same names; its experts plain tensors)
    plain = _fit(tmp_path / "c", fp8=False, async_save=async_save, resume=step2, steps=3)
    assert plain.step == 2 and plain.types == {"Parameter"}
    for name in names:
        assert torch.equal(plain.start[name], weights[name]), name

    # HF: the export of the weights and of the EMA, and save_pretrained of the FP8 model itself,
    # write what save_pretrained of a model without FP8 writes for the same weights
    step4 = tmp_path / "a" / "step-4"
    expected = _plain_save_pretrained(uninterrupted.end, tmp_path / "hf_plain")
    _assert_same_tensors(_hf_tensors(export(step4, tmp_path / "hf")), expected)
    _assert_same_tensors(_hf_tensors(save_pretrained(uninterrupted.model, tmp_path / "hf_fp8_model")), expected)
    ema = {k.removeprefix(ema_prefix): v for k, v in read_full_tensors(step4 / "shards").items()
           if k.startswith(ema_prefix)}
    _assert_same_tensors(_hf_tensors(export(step4, tmp_path / "hf_ema", weights="ema")),
                         _plain_save_pretrained({**uninterrupted.end, **ema}, tmp_path / "hf_plain_ema"))


def test_plain_tensor_unwraps_torchaos_weight_wrapper_and_refuses_other_subclasses():
    """What the checkpoint writer stores for a tensor: a plain one as it is, torchao's expert-weight
    wrapper as the weight it wraps (the same storage), an FP8 tensor of data and scales not at all."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    weight = torch.randn(4, 32, 16)
    assert plain_tensor(weight) is weight
    wrapped = Float8TrainingWeightWrapperTensor(weight, Float8TrainingOpConfig())
    assert type(plain_tensor(wrapped)) is torch.Tensor and plain_tensor(wrapped).data_ptr() == weight.data_ptr()
    assert type(plain_tensor(torch.nn.Parameter(wrapped).detach())) is torch.Tensor
    fp8 = hp_tensor_to_float8_dynamic(weight[0], torch.float8_e4m3fn, LinearMMConfig())
    with pytest.raises(TypeError, match="does not wrap one tensor of its own shape and dtype"):
        plain_tensor(fp8)
