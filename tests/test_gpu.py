"""Training on a CUDA GPU (``pytest -m gpu``; skipped without CUDA, with the reason; run by
scripts/gpu_check.sh): every precision through recipes/pretrain.py for 20 steps on the tiny V3 (MTP
on) and the dense tiny model, compile on and off, flash-attn where installed, the grouped expert
GEMM in bf16, and a checkpoint saved and resumed on the GPU.

What the CPU suite checks instead: the kernels' shape rules and the padding that meets them
(tests/test_fp8_kernel_rules.py), compile against eager with inductor on CPU (tests/test_compile.py).
"""

from __future__ import annotations

import importlib.util
import math
import shutil

import pytest
import torch

from tests.test_pretrain_e2e import losses, metric, run_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GPU = ["trainer.accelerator=gpu", "trainer.max_steps=20", "logger=csv", "checkpoint.every_n_steps=0",
       "checkpoint.every_minutes=0", "trainer.peak_tflops=null"]
MODELS = {"v3": [], "dense": ["model=deepseek_llm_tiny"]}
# (model, precision, compile): bf16 and every FP8 recipe on both models with compile (the CUDA
# default), each precision once more eager on V3
CASES = [
    (model, precision, compiled)
    for precision in ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise")
    for model, compiled in (("v3", True), ("dense", True), ("v3", False))
]


def train_losses(run_dir) -> list[float]:
    values = [float(v) for _, v in sorted(losses(run_dir).items())]
    assert len(values) == 20 and all(math.isfinite(v) for v in values)
    return values


@pytest.mark.parametrize("model, precision, compiled", CASES, ids=[f"{m}-{p}-{'compile' if c else 'eager'}" for m, p, c in CASES])
def test_pretrain_recipe_trains_on_the_gpu(tmp_path, model, precision, compiled):
    result = run_recipe(tmp_path, *GPU, *MODELS[model], f"precision={precision}", f"trainer.compile={str(compiled).lower()}")
    log_text = (tmp_path / "pretrain.log").read_text() + result.stderr
    values = train_losses(tmp_path)
    assert values[-1] < values[0] - 1.0, values
    if precision.startswith("fp8"):  # torchao's kernels ran: no fallback to the reference path
        assert "reference path" not in log_text, log_text[-2000:]
    assert ("transformer blocks compiled" in log_text) == compiled
    assert float(metric(tmp_path, "perf/mfu")[19]) > 0


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed (EXTRAS=dev,gpu)")
def test_flash_attention_backend_trains(tmp_path):
    run_recipe(tmp_path, *GPU, "precision=bf16", "+model.attn_backend=flash_attn")
    values = train_losses(tmp_path)
    assert values[-1] < values[0] - 1.0


def test_grouped_expert_gemm_runs_in_bf16_on_the_gpu(caplog):
    """``torch._grouped_mm`` (bf16, sm90+) against the per-expert matmuls on the same tokens."""
    from dsl_lit.models.common.moe import GroupedExperts

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs sm90+")
    torch.manual_seed(0)
    grouped = GroupedExperts(8, 256, 512, backend="grouped_mm").cuda()
    for w in (grouped.w1, grouped.w2, grouped.w3):
        torch.nn.init.normal_(w, std=0.05)
    split = GroupedExperts(8, 256, 512, backend="split").cuda()
    split.load_state_dict(grouped.state_dict())
    counts = torch.tensor([100, 0, 37, 200, 5, 64, 1, 33], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, ref = grouped(x, counts), split(x, counts)
    assert out.dtype == torch.bfloat16 and "not available" not in caplog.text
    # both bf16 GEMMs with fp32 accumulation, summed in different orders: a few bf16 ulps
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_checkpoint_saved_and_resumed_on_the_gpu(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = [a for a in GPU if not a.startswith("checkpoint.")] + ["checkpoint.every_n_steps=10", "precision=bf16"]
    run_recipe(full, *args)
    shutil.copytree(full / "checkpoints" / "step-10", resumed / "checkpoints" / "step-10")
    run_recipe(resumed, *args)
    reference, after = losses(full), losses(resumed)
    assert sorted(after) == list(range(10, 20))
    # the same step on the same GPU; CUDA's atomics (index_add_, scatter) may reorder sums
    for step in range(10, 20):
        assert float(after[step]) == pytest.approx(float(reference[step]), rel=1e-3), step
