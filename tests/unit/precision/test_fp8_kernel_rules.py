"""The GPU FP8 kernels' shape rules on the CPU reference path, and the padding that meets them.

Each rule mirrors one kernel check of torch 2.11 / torchao 0.18 (``dsl_lit.precision.fp8_kernel_rules``):

* ``_scaled_mm`` (tensorwise, rowwise), ``aten/src/ATen/native/cuda/Blas.cpp``: "Expected trailing
  dimension of mat1 to be divisible by 16 but got mat1 shape: (MxK)." and "mat2 shape (KxN) must
  be divisible by 16". The first is the crash an H200 run of ``precision.fp8=fp8_rowwise`` hit
  with MTP on (256x1016: wgrad contracts over 8 x 127 tokens).
* torchao's blockwise Linear, ``prototype/blockwise_fp8_training/kernels.py``:
  ``triton_fp8_blockwise_act_quant_transposed_lhs`` "First dimension size must be divisible by
  block_size (block_size=128)" (wgrad's 128x1 token tiles; the ``fp8_blockwise`` crash on the
  H200), ``triton_fp8_blockwise_act_quant_lhs`` "Last dimension size must be divisible by block_size"
  (fprop and dgrad), ``triton_fp8_blockwise_weight_quant_*`` "Both dimensions of x must be
  divisible by block_size".
* torchao's FP8 grouped GEMM, ``prototype/moe_training/fp8_grouped_mm.py``: "Group sizes must be
  divisible by 16" (a device-side assert in ``torch._scaled_grouped_mm`` on the GPU: the
  ``fp8_blockwise`` run with ``mtp_depth=0`` died of it).

Without padding (``apply_fp8(pad_tokens=False)``) the reference refuses the shapes the GPU refused;
with it (the default), the same models train, and the padding changes no value.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.token_padding import align_token_groups, call_with_padded_tokens
from dsl_lit.precision.fp8 import FP8_RECIPES, Fp8GroupedExperts, Fp8Linear, apply_fp8, fp8_linear
from dsl_lit.precision.fp8_kernel_rules import check_gemm, check_token_groups
from tests.numerics import assert_close_fp32
from tests.recipe_runs import losses, run_recipe
from tests.unit.precision.test_fp8 import four_experts


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SCALED_MM_MAT1 = "Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (256x1016)."
BLOCKWISE_WGRAD = r"First dimension size must be divisible by block_size \(block_size=128\)"


@pytest.mark.parametrize(
    "recipe, gemm, a, b, message",
    [
        # _scaled_mm: mat1 = a [m, k]; mat2 = b^T [k, n]
        ("fp8_rowwise", "wgrad", (256, 1016), (512, 1016), r"mat1 shape: \(256x1016\)\."),
        ("fp8_tensorwise", "fprop", (8, 520), (256, 520), r"mat1 shape: \(8x520\)\."),
        ("fp8_tensorwise", "fprop", (8, 512), (200, 512), r"mat2 shape \(512x200\) must be divisible by 16"),
        # blockwise: act_quant_transposed_lhs (wgrad), act_quant_lhs (fprop/dgrad), weight quant
        ("fp8_blockwise", "wgrad", (256, 1016), (512, 1016), BLOCKWISE_WGRAD),
        ("fp8_blockwise", "fprop", (1016, 200), (256, 200), r"Last dimension size must be divisible by block_size"),
        ("fp8_blockwise", "dgrad", (1016, 256), (200, 256), r"Both dimensions of x must be divisible by block_size"),
    ],
)
def test_each_rule_raises_the_kernels_message(recipe, gemm, a, b, message):
    with pytest.raises((RuntimeError, AssertionError), match=message):
        check_gemm(recipe, gemm, a, b)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise", "fp8_tensorwise"])
def test_token_multiples_pass_every_rule(recipe):
    multiple = 128 if recipe == "fp8_blockwise" else 16
    for gemm, a, b in (("fprop", (multiple * 3, 256), (512, 256)), ("dgrad", (multiple * 3, 512), (256, 512)),
                       ("wgrad", (512, multiple * 3), (256, multiple * 3))):
        check_gemm(recipe, gemm, a, b)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_the_mtp_shapes_crash_unpadded_and_padding_changes_no_value(recipe):
    """8 x 127 tokens (MTP's shifted sequences) through a 512 -> 256 Linear: the reference without
    padding fails as the H200 did; :class:`Fp8Linear` pads and gives the unpadded values (GEMMs
    computed with the checks off) up to fp32 reordering of the 1016-long wgrad sums."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(256, 512) * 0.05)
    x = torch.randn(8, 127, 512, requires_grad=True)
    dy = torch.randn(8, 127, 256)
    expected = SCALED_MM_MAT1 if recipe != "fp8_blockwise" else BLOCKWISE_WGRAD
    out = fp8_linear(x, weight, recipe)  # fprop's k is 512: only backward's wgrad breaks a rule
    with pytest.raises((RuntimeError, AssertionError), match=expected if recipe == "fp8_blockwise" else r"\(256x1016\)"):
        out.backward(dy)

    def step(forward):
        x.grad = weight.grad = None
        y = forward(x)
        y.backward(dy)
        return y.detach(), x.grad.clone(), weight.grad.clone()

    layer = Fp8Linear(512, 256, bias=False, recipe=recipe)
    layer.weight = weight
    padded = step(layer)
    unchecked = step(lambda t: fp8_linear(t, weight, recipe, checks=False))
    for got, ref, length in zip(padded, unchecked, (512, 256, 1016)):
        assert_close_fp32(got, ref, length)


def test_align_token_groups_layout():
    counts = torch.tensor([100, 0, 37, 16, 5])
    x = torch.randn(int(counts.sum()), 8)
    padded, padded_counts, positions = align_token_groups(x, counts, 16)
    assert padded.shape[0] == math.ceil((158 + 5 * 16) / 16) * 16  # from shapes alone: no host sync
    assert padded_counts.tolist()[:4] == [112, 16, 48, 16] and padded_counts.sum() == padded.shape[0]
    assert all(c % 16 == 0 for c in padded_counts.tolist())
    assert torch.equal(padded[positions], x)
    rest = torch.ones(padded.shape[0], dtype=torch.bool)
    rest[positions] = False
    assert padded[rest].abs().sum() == 0
    starts = (padded_counts.cumsum(0) - padded_counts).tolist()
    assert positions[:100].tolist() == list(range(100)) and positions[100] == starts[2]


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_experts_refuse_unaligned_groups_and_align_them_exactly(recipe):
    experts, x, counts = four_experts()
    unpadded = Fp8GroupedExperts.convert(copy.deepcopy(experts), recipe, pad_tokens=False)
    with pytest.raises(RuntimeError, match="Group sizes must be divisible by 16"):
        unpadded(x, counts)
    with pytest.raises(RuntimeError, match="Group sizes must be divisible by 16"):
        check_token_groups([100, 0, 37, 200])
    aligned = Fp8GroupedExperts.convert(copy.deepcopy(experts), recipe)
    out = aligned(x, counts)

    def expert(h, e):  # the same FP8 GEMMs on the unpadded group, checks off
        def linear(a, w):
            return fp8_linear(a, w[e], recipe, checks=False)
        return linear(F.silu(linear(h, experts.w1)) * linear(h, experts.w3), experts.w2)

    reference = torch.cat([expert(chunk, e) for e, chunk in enumerate(x.split(counts.tolist())) if len(chunk)])
    assert_close_fp32(out, reference, 256)


PRESETS = [("deepseek_v3_tiny", "grouped_mm"), ("deepseek_v3_tiny", "split"), ("deepseek_v2_tiny", "grouped_mm"),
           ("deepseek_v2_tiny", "split"), ("deepseek_llm_tiny", None), ("deepseek_v32_tiny", "grouped_mm"),
           ("deepseek_v4_tiny", "grouped_mm")]  # (preset, expert backend: None, dense)


@pytest.mark.parametrize("preset, expert_backend", PRESETS)
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_every_preset_trains_on_odd_token_counts(preset, recipe, expert_backend):
    """Forward (with MTP where the preset has it) and backward on 3 x 45 tokens: unpadded, some
    GEMM or expert group breaks a kernel rule; padded, every rule holds and the gradients are finite."""
    cfg = ModelConfig.from_name(preset)
    if expert_backend is not None:
        cfg.expert_backend = expert_backend
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 46))

    def loss(m: nn.Module) -> torch.Tensor:
        hidden = m.hidden_states(tokens[:, :-1])
        total = F.cross_entropy(m.head(hidden).flatten(0, 1), tokens[:, 1:].flatten())
        for logits in m.mtp_logits(hidden, tokens[:, :-1]):
            total = total + F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten())
        return total

    unpadded = copy.deepcopy(model)
    assert apply_fp8(unpadded, recipe, pad_tokens=False) > 0
    with pytest.raises((RuntimeError, AssertionError), match="divisible by"):
        loss(unpadded).backward()
    apply_fp8(model, recipe)
    loss(model).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_padding_helper_is_a_no_op_on_multiples():
    x = torch.randn(4, 32, 8)
    calls = []
    out = call_with_padded_tokens(lambda t: calls.append(t.shape) or t * 2, x, 16)
    assert calls == [x.shape] and torch.equal(out, x * 2)
    out = call_with_padded_tokens(lambda t: calls.append(t.shape) or t * 2, x[:, :31], 16)
    assert calls[-1] == (128, 8) and torch.equal(out, x[:, :31] * 2)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise"])
def test_pretrain_recipe_trains_each_fp8_recipe_with_mtp(tmp_path, recipe):
    """recipes/pretrain.py under ``precision=fp8_tensorwise`` / ``fp8_rowwise`` (conf/precision), V3
    tiny with MTP and micro-batches of 3 x 64 tokens (3 x 63 = 189 MTP tokens: no multiple of 16):
    the reference path enforces the GPU kernels' rules, so this run failed before the layers padded
    their tokens. (``fp8_blockwise``, whose MTP sees 4 x 63 tokens: tests/unit/precision/test_fp8.py.)"""
    run_recipe(tmp_path, f"precision={recipe}", "trainer.max_steps=3", "logger=csv",
               "data.micro_batch_size=3", "data.global_batch_size=6")
    loss = [float(v) for _, v in sorted(losses(tmp_path).items())]
    assert len(loss) == 3 and all(math.isfinite(v) for v in loss)
    assert loss[2] < loss[0]


def test_no_tokens_pass_through_padding():
    """A batch (or an expert group) of zero tokens is padded to one group of zeros and cropped back
    (torchao's kernels take no empty operand)."""
    layer = Fp8Linear(512, 256, bias=False, recipe="fp8_rowwise")
    out = layer(torch.zeros(0, 512))
    assert out.shape == (0, 256)
