"""The FP8 reference path against torchao 0.18's own code, run on CPU: Float8 training's tensorwise
and rowwise Linears (``convert_to_float8_training``, forward and backward), the routed-expert
weight wrapper, and the pure-PyTorch blockwise quantisers. Equality is bit for bit (torch.equal)
wherever torchao computes what the reference does; the two documented differences are asserted
as what they are (torchao rounding a result to bf16), so that neither can widen unnoticed.

torchao multiplies on CPU through ``torch._scaled_mm``. With oneDNN enabled, on CPUs with AMX it
picks oneDNN's FP8 matmul, which sums in an order of its own; these tests turn oneDNN off so that
``_scaled_mm`` takes its plain path (dequantise to fp32, ``matmul``), the reference's arithmetic."""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import LinearMMConfig

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.moe import MoE
from dsl_lit.precision.fp8 import Fp8GroupedExperts, QuantSpec, apply_fp8, fp8_linear, quantize_fp8

BF16 = torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(autouse=True)
def plain_scaled_mm():
    """oneDNN off (see the module docstring), one thread (tiny ops on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.backends.mkldnn.flags(enabled=False):
        yield
    torch.set_num_threads(threads)


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.contiguous().view(torch.uint8)


def bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).to(t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "block, fp8_dtype, pow2",
    [((0, 0), E4M3, False), ((0, 0), E5M2, False), ((1, 0), E4M3, False), ((1, 0), E4M3, True)],
    ids=["tensorwise-e4m3", "tensorwise-e5m2", "rowwise-e4m3", "rowwise-e4m3-pow2"],
)
def test_quantiser_equals_torchaos_float8_cast(block, fp8_dtype, pow2, dtype):
    """``quantize_fp8`` against the cast every torchao Float8 GEMM operand goes through
    (``hp_tensor_to_float8_dynamic``): same FP8 bits, scale = 1 / torchao's multiplier. The
    rowwise cases check 300 scales at once; an fp32 ``amax / 448`` differs in the last bit for ~1 in 4."""
    torch.manual_seed(0)
    x = (torch.randn(300, 200) * torch.exp(torch.randn(300, 200) * 3)).to(dtype)
    x[7] = 0  # an all-zero row
    granularity = ScalingGranularity.AXISWISE if block == (1, 0) else ScalingGranularity.TENSORWISE
    theirs = hp_tensor_to_float8_dynamic(
        x, fp8_dtype, LinearMMConfig(), scaling_granularity=granularity,
        axiswise_dim=-1 if block == (1, 0) else None, round_scales_to_power_of_2=pow2,
    )
    q, scale = quantize_fp8(x, QuantSpec(block, fp8_dtype, pow2))
    assert torch.equal(bits(q), bits(theirs._data))
    assert torch.equal(scale.view(theirs._scale.shape), theirs._scale.reciprocal())


# mode -> (module dtype, autocast); and how torchao's out, dX, dW relate to the reference's
MODES = {"fp32": (torch.float32, False), "bf16": (BF16, False), "autocast": (torch.float32, True)}
SAME, ROUNDED = "identical", "ours rounded to bf16"
EXPECTED = {
    ("tensorwise", "fp32"): (SAME, SAME, SAME),
    ("tensorwise", "bf16"): (SAME, SAME, SAME),
    ("rowwise", "bf16"): (SAME, SAME, SAME),
    # torchao asks _scaled_mm for bf16 whenever the scaling is rowwise and the output would be
    # fp32 (float8_ops.addmm_float8_unwrapped), then casts back
    ("rowwise", "fp32"): (ROUNDED, ROUNDED, ROUNDED),
    # under CPU autocast the FP8 GEMMs return the incoming gradient's dtype (bf16); the
    # reference returns dX and dW from its fp32 accumulator
    ("tensorwise", "autocast"): (SAME, ROUNDED, ROUNDED),
    ("rowwise", "autocast"): (SAME, ROUNDED, ROUNDED),
}


def linear_step(linear: nn.Module, x: torch.Tensor, dy: torch.Tensor, autocast: bool, forward: Callable):
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = forward(x)
    dx, dw = torch.autograd.grad(out, (x, linear.weight), dy.to(out.dtype))
    return out, dx, dw


@pytest.mark.parametrize("recipe, mode", list(EXPECTED), ids=[f"{r}-{m}" for r, m in EXPECTED])
def test_linear_equals_torchao_float8_training(recipe, mode):
    dtype, autocast = MODES[mode]
    torch.manual_seed(0)
    linear = nn.Linear(512, 1024, bias=False).to(dtype)
    torchao_model = nn.Sequential(copy.deepcopy(linear))
    convert_to_float8_training(torchao_model, config=Float8LinearConfig.from_recipe_name(recipe))
    assert type(torchao_model[0]) is Float8Linear
    # 100 tokens whose magnitudes spread over binades (a log-normal factor per token); at these
    # sizes this CPU's BLAS sums dY W in another order when W is passed transposed (see _gemm)
    x = (torch.randn(2, 50, 512) * torch.exp(torch.randn(2, 50, 1))).to(dtype)
    dy = torch.randn(2, 50, 1024)
    theirs = linear_step(torchao_model[0], x, dy, autocast, torchao_model)
    # checks=False: 100 tokens break the CUDA kernels' rule (tests/unit/precision/test_fp8_kernel_rules.py), which
    # torch's CPU _scaled_mm does not apply
    ours = linear_step(linear, x, dy, autocast, lambda t: fp8_linear(t, linear.weight, f"fp8_{recipe}", checks=False))
    for name, relation, a, b in zip(("out", "dX", "dW"), EXPECTED[recipe, mode], theirs, ours):
        assert a.dtype == b.dtype, name
        if relation == SAME:
            assert torch.equal(a, b), name
        else:
            assert torch.equal(a, bf16_rounded(b)) and not torch.equal(a, b), name


def tiny_v3_bf16(expert_backend: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("deepseek_v3_tiny")
    cfg.expert_backend = expert_backend
    return build_model(cfg).to(BF16)


def logits_and_grads(model: nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    return [logits] + [p.grad for p in model.parameters() if p.grad is not None]  # (MTP: not in forward)


def test_apply_fp8_torchao_backend_runs_on_cpu_and_equals_the_reference():
    """The whole tiny DeepSeek-V3 (bf16, ``fp8_rowwise``, routed experts on the ``split`` backend):
    torchao's modules through ``apply_fp8(backend="torchao")`` against the reference path, logits
    and every parameter's gradient bit for bit. The state dict keeps its keys."""
    theirs, ours = tiny_v3_bf16("split"), tiny_v3_bf16("split")
    keys = list(theirs.state_dict())
    n = apply_fp8(theirs, "fp8_rowwise", backend="torchao")
    assert apply_fp8(ours, "fp8_rowwise", backend="reference") == n == 41 + 4  # all Linears but the head
    assert isinstance(theirs.layers["1"].attention.wkv_a, Float8Linear) and type(theirs.output) is nn.Linear
    assert type(theirs.layers["1"].feed_forward.experts.w1.data).__name__ == "Float8TrainingWeightWrapperTensor"
    assert list(theirs.state_dict()) == keys
    tokens = torch.randint(0, 8192, (2, 48), generator=torch.Generator().manual_seed(1))
    for a, b in zip(logits_and_grads(theirs, tokens), logits_and_grads(ours, tokens), strict=True):
        assert torch.equal(a, b)


def test_torchao_backend_refuses_what_needs_cuda_before_swapping_anything():
    model = tiny_v3_bf16("grouped_mm")
    with pytest.raises(RuntimeError, match="expert_backend=grouped_mm.*Triton"):
        apply_fp8(model, "fp8_rowwise", backend="torchao")
    with pytest.raises(RuntimeError, match="blockwise.*Triton"):
        apply_fp8(model, "fp8_blockwise", backend="torchao", include_experts=False)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


@pytest.mark.parametrize("expert_backend", ["split", "loop"])
def test_torchao_routed_experts_are_fp8_under_split_and_loop(expert_backend):
    """torchao's expert-weight wrapper survives ``models.moe.expert_weight`` (indexing ``w[e]``
    dropped it: the experts ran in high precision). One MoE layer in bf16: torchao's experts
    equal the reference's ``fp8_rowwise`` experts bit for bit, and differ from bf16 experts."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("deepseek_v3_tiny")
    cfg.expert_backend = expert_backend
    moe = MoE(cfg)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.05)
    moe = moe.to(BF16)
    x = torch.randn(2, 64, 256, dtype=BF16)
    theirs, ours = copy.deepcopy(moe), copy.deepcopy(moe)
    assert apply_fp8(theirs, "fp8_rowwise", filter_fqns=("shared_experts",), backend="torchao") == 1
    Fp8GroupedExperts.convert(ours.experts, "fp8_rowwise")

    def run(m: nn.Module) -> list[torch.Tensor]:
        out = m(x)
        out.float().square().mean().backward()
        return [out, m.experts.w1.grad, m.experts.w2.grad, m.experts.w3.grad]

    high, got, ref = run(moe), run(theirs), run(ours)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], high[0])


def torchao_blockwise_quantisers() -> dict[str, Callable]:
    """torchao 0.18's pure-PyTorch blockwise quantisers (``torch_blockwise_scale_*`` of
    ``torchao.prototype.blockwise_fp8_training.kernels``). That module imports Triton at the top,
    absent on a CPU-only install; then these three functions (and the two constants they read)
    are compiled, unchanged, from the installed file."""
    module = "torchao.prototype.blockwise_fp8_training.kernels"
    names = ("torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_act_quant_rhs",
             "torch_blockwise_scale_weight_quant")
    try:
        kernels = importlib.import_module(module)
        return {name: getattr(kernels, name) for name in names}
    except ImportError:
        pass
    source = Path(importlib.util.find_spec(module).origin)
    tree = ast.parse(source.read_text())
    wanted = [
        node for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in names)
        or (isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} & {"EPS", "FP8_E4M3_DTYPES"})
    ]
    assert len(wanted) == 5, "torchao moved its blockwise quantisers"

    from torchao.float8.config import e4m3_dtype

    namespace = {"torch": torch, "Tuple": tuple, "e4m3_dtype": e4m3_dtype}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(source), "exec"), namespace)
    return {name: namespace[name] for name in names}


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_blockwise_quantisers_equal_torchaos(dtype):
    """The three groupings of DeepSeek-V3's recipe: 1x128 (activations, dY), 128x1 (X and dY over
    tokens for wgrad) and 128x128 (weights): same FP8 bits and same scales (torchao returns
    the reciprocal of its multiplier, as ``quantize_fp8`` does)."""
    quant = torchao_blockwise_quantisers()
    torch.manual_seed(0)
    x = (torch.randn(256, 384) * torch.exp(torch.randn(256, 384) * 3)).to(dtype)
    x[0, 128:256] = 0  # an all-zero 1x128 tile
    if dtype == torch.float32:
        # an all-zero 128x1 tile: torchao's 128x1 quantiser clamps amax to 1e-12 in the input's
        # dtype (its others, and ours, in float64), so in bf16 that tile's scale differs; its
        # values are 0 either way
        x[:128, 5] = 0
    q, scale = quantize_fp8(x, QuantSpec((1, 128)))
    q_ao, scale_ao = quant["torch_blockwise_scale_act_quant_lhs"](x)
    assert torch.equal(bits(q), bits(q_ao)) and torch.equal(scale, scale_ao)
    q, scale = quantize_fp8(x.T, QuantSpec((1, 128)))  # 128x1 tiles of x = 1x128 tiles of x^T
    q_ao, scale_ao = quant["torch_blockwise_scale_act_quant_rhs"](x)
    assert torch.equal(bits(q.T), bits(q_ao)) and torch.equal(scale.T, scale_ao)
    q, scale = quantize_fp8(x, QuantSpec((128, 128)))
    q_ao, scale_ao = quant["torch_blockwise_scale_weight_quant"](x)
    assert torch.equal(bits(q), bits(q_ao)) and torch.equal(scale, scale_ao)
