"""FP8 training as a module swap applied to a built model from outside (the models stay plain PyTorch).

``apply_fp8(model, recipe)`` swaps the eligible ``nn.Linear`` s (and, optionally, the routed experts
of DeepSeekMoE) in place; parameter names, shapes and dtypes do not change, so checkpoints and the
optimizer are unaffected: the FP8 copies are made on the fly in every forward and backward and
the fp32/bf16 master weight stays the parameter.

Recipes (``FP8_RECIPES``); every GEMM of a Linear (fprop ``Y = X W^T``, dgrad ``dX = dY W``, wgrad
``dW = dY^T X``) runs on FP8 operands with fp32 accumulation. Scales are online ("dynamic"): the
amax of the tile at hand, no history.

Every group of elements sharing a scale is quantised as torchao does it: multiplier =
fp32(fp8_max / float64(amax)), ``q = fp8(clamp(x * multiplier))``, dequantised as
``q * fp32(1 / multiplier)``; with power-of-two scales the multiplier is rounded down to one.

* ``fp8_tensorwise``: one scale per tensor; X and W in E4M3, dY in E5M2 (torchao's "tensorwise").
* ``fp8_rowwise``: one scale per row along the contraction dim of each GEMM, all E4M3,
  power-of-two scales (torchao's "rowwise").
* ``fp8_blockwise``: DeepSeek-V3's recipe (arXiv 2412.19437, section 3.3). E4M3 everywhere
  ("mantissa over exponents"); one scale per tile (online, amax / 448); activations and the gradients
  w.r.t. activations in 1x128 tiles (per token per 128 channels), weights in 128x128 blocks.
  What we implement per GEMM, every scale group lying along that GEMM's contraction dim (the
  condition for the paper's per-128-element promotion to fp32, figure 7b):

  - fprop: X in 1x128 tiles, W in 128x128 blocks;
  - dgrad: dY in 1x128 tiles (per token per 128 output channels), W in the same 128x128 blocks;
  - wgrad: dY and X both in 128x1 tiles (per channel per 128 tokens), the contraction being over
    tokens. As in section 3.3.3 / 3.5.2 the input is *cached in FP8* (its 1x128 fprop copy) for
    backward, and wgrad dequantises that copy and re-quantises it to 128x1 tiles
    (``cache_fp8_input=True``; torchao's kernel keeps the bf16 input instead, see
    ``BLOCKWISE_TORCHAO_LIKE``).

  In the paper but not reproduced here: the E5M6 cache for the input of the Linear after
  attention, power-of-two scales for the MoE dispatch activations and the gradient before the MoE
  down-projection, FP8 all-to-all communication, BF16 optimizer moments, and the limited (~14-bit)
  accumulation of Hopper tensor cores that the per-128 promotion works around (we accumulate in
  full fp32).

Which modules (``DEFAULT_FP8_FILTER_FQNS`` and the dims rule): DeepSeek-V3 keeps "the embedding
module, the output head, MoE gating modules, normalization operators, and attention operators" in
their original precision. Embedding, norms, the router (``TopKRouter`` holds a bare ``weight``) and
attention (SDPA) are not ``nn.Linear`` in our models, so only the head (``output``) has to be
filtered by name; ``gate`` and ``tok_embeddings`` are listed for models where they are Linears.
MLA's projections, down-projections included (``wq_a``, ``wkv_a``), are FP8 in the paper, and so
is the MTP projection ``eh_proj``. A Linear is also skipped when ``in_features`` or
``out_features`` is not a multiple of 128 (blockwise) or 16 (tensorwise / rowwise): the GPU
kernels need it, and the reference path keeps the same rule so CPU and GPU runs agree on *which*
modules are FP8 (on ``deepseek_v3_tiny`` that leaves ``wkv_a`` (80 out), ``wkv_b`` (64 in) and
the dense FFN (688) in high precision under blockwise).

Where it runs (``apply_fp8``'s ``backend``):

* ``"auto"`` on a GPU (CUDA, torchao importable): ``fp8_tensorwise`` / ``fp8_rowwise`` through
  ``torchao.float8.convert_to_float8_training`` (SM89+ / SM90+); ``fp8_blockwise`` through
  ``torchao.prototype.blockwise_fp8_training.linear.Float8BlockwiseLinear`` (SM90+, bf16 outputs,
  no bias). Routed experts through ``torchao.prototype.moe_training``'s ``Float8TrainingOpConfig``
  (SM90+), which wraps the expert weights so that ``torch._grouped_mm`` (``expert_backend=
  grouped_mm``) and ``F.linear`` on one expert's slice (``split``, ``loop``; the slice is taken by
  ``models.moe.expert_weight``, which keeps the wrapper) run in FP8: torchao 0.18 offers only
  *rowwise* scaling there, so under ``fp8_blockwise`` or ``fp8_tensorwise`` the experts are rowwise
  on GPU (logged).
* ``"auto"`` anywhere else (this CPU machine): the pure-PyTorch reference path below, with a
  warning naming the recipe and the reason. It quantises to ``torch.float8_e4m3fn`` /
  ``float8_e5m2`` with the recipe's scales (clamp to the format's max, round-to-nearest-even by
  the dtype cast), dequantises and multiplies in fp32: the numerics of an FP8 GEMM with fp32
  accumulation, with no speed-up (it is slower than bf16). Routed experts get the same per
  expert (:class:`Fp8GroupedExperts`, one GEMM per expert on its sorted tokens) under every
  ``expert_backend``.
* ``"torchao"`` on CPU: torchao's tensorwise / rowwise Linears run there too (torch's
  ``_scaled_mm`` has a CPU implementation), and so do its routed experts under
  ``expert_backend=split`` or ``loop``; its blockwise Linear and FP8 grouped GEMM are Triton
  kernels (CUDA only), so asking for those raises.

The reference path against torchao 0.18 on CPU (tests/test_fp8_torchao.py; oneDNN off, so that torch's
``_scaled_mm`` dequantises and multiplies in fp32 as the reference does): outputs, dX and dW are
bit-identical for ``fp8_tensorwise`` (fp32 and bf16 modules) and ``fp8_rowwise`` (bf16), and so are
routed experts under torchao (``split`` / ``loop``) and the reference's ``fp8_rowwise`` experts. Not
identical, by design: torchao rounds every rowwise GEMM output through bf16 (``_scaled_mm`` has no
fp32 rowwise output), so fp32 ``fp8_rowwise`` equals ours rounded to bf16; under CPU autocast with
fp32 weights the forward is identical but torchao returns dX and dW rounded to bf16 (the incoming
gradient's dtype) where ours keeps the fp32 accumulator. The blockwise quantisers (1x128, 128x1,
128x128) give the bits and scales of torchao's pure-PyTorch ones; torchao's blockwise GEMMs are GPU
kernels, not comparable here. With oneDNN on (the default; torch picks its FP8 matmul on CPUs with
AMX) the sums run in another order and the last bits differ. The GPU kernels have not been run in
this repo's CI (no GPU).

Limits of the reference path: expert parallelism's dispatch calls ``grouped_swiglu`` on the local
expert shards directly, bypassing :class:`Fp8GroupedExperts`, so with ``ep > 1`` the routed
experts stay in high precision; both orders warn (apply_fp8 skips experts whose weights are
already sharded, and sharding an :class:`Fp8GroupedExperts` logs it). Tensor-parallel (DTensor)
weights are not supported by the reference path.

Measured on CPU (tests/test_fp8.py, benchmarks/fp8_reference_error.py): the FP8 values equal a
float64 emulation of this arithmetic bit for bit (dequantised values to one fp32 rounding), the
Linear's three GEMMs match a float64 emulation of the recipe to ~4e-7 and are ~3.7% off fp32
(bf16: 0.24%), and five AdamW steps of ``deepseek_v3_tiny`` under ``fp8_blockwise`` end within
0.3-1.1% of the fp32 loss (seeds 0-5).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dsl_lit.models.common.moe import GroupedExperts
from dsl_lit.models.common.token_padding import call_with_padded_tokens
from dsl_lit.precision.fp8_kernel_rules import (
    GROUPED_MM_GROUP_MULTIPLE,
    check_gemm,
    check_token_groups,
    token_multiple,
)

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX: dict[torch.dtype, float] = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344
AMAX_EPS = 1e-12
"""Floor of a tile's amax, so an all-zero tile gets a finite scale (its values stay 0)."""


@dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantised. The operand is seen as ``[rows, k]`` with ``k`` the
    contraction dim; ``block = (rows, k)`` elements share one scale, ``0`` meaning the whole dim
    (``(1, 128)``: 1x128 tiles; ``(128, 128)``: blocks; ``(1, 0)``: rowwise; ``(0, 0)``: tensorwise)."""

    block: tuple[int, int]
    dtype: torch.dtype = E4M3
    pow2_scales: bool = False


@dataclass(frozen=True)
class Fp8Recipe:
    """Quantisation of each operand of the three GEMMs of ``Y = X W^T``, each in ``[rows, k]`` layout:
    fprop ``X [tokens, in]`` and ``W [out, in]``; dgrad ``dY [tokens, out]`` and ``W^T [in, out]``;
    wgrad ``dY^T [out, tokens]`` and ``X^T [in, tokens]``."""

    name: str
    x: QuantSpec
    w: QuantSpec
    dy: QuantSpec
    w_t: QuantSpec
    dy_t: QuantSpec
    x_t: QuantSpec
    dim_multiple: int
    """in/out features must be multiples of this (the GPU kernels' constraint)."""
    cache_fp8_input: bool = False
    """Save the fprop's FP8 copy of X for wgrad (DeepSeek-V3) instead of the high-precision X."""
    allows_bias: bool = True


_TENSOR, _ROW, _TILE, _BLOCK = (0, 0), (1, 0), (1, 128), (128, 128)

RECIPES: dict[str, Fp8Recipe] = {
    "fp8_tensorwise": Fp8Recipe(
        "fp8_tensorwise",
        x=QuantSpec(_TENSOR), w=QuantSpec(_TENSOR),
        dy=QuantSpec(_TENSOR, E5M2), w_t=QuantSpec(_TENSOR),
        dy_t=QuantSpec(_TENSOR, E5M2), x_t=QuantSpec(_TENSOR),
        dim_multiple=16,
    ),
    "fp8_rowwise": Fp8Recipe(
        "fp8_rowwise",
        x=QuantSpec(_ROW, pow2_scales=True), w=QuantSpec(_ROW, pow2_scales=True),
        dy=QuantSpec(_ROW, pow2_scales=True), w_t=QuantSpec(_ROW, pow2_scales=True),
        dy_t=QuantSpec(_ROW, pow2_scales=True), x_t=QuantSpec(_ROW, pow2_scales=True),
        dim_multiple=16,
    ),
    "fp8_blockwise": Fp8Recipe(
        "fp8_blockwise",
        x=QuantSpec(_TILE), w=QuantSpec(_BLOCK),
        dy=QuantSpec(_TILE), w_t=QuantSpec(_BLOCK),
        dy_t=QuantSpec(_TILE), x_t=QuantSpec(_TILE),  # i.e. 128x1 tiles of dY and X, over tokens
        dim_multiple=128, cache_fp8_input=True, allows_bias=False,
    ),
}
FP8_RECIPES: tuple[str, ...] = tuple(RECIPES)
"""The recipe names ``apply_fp8`` accepts."""

BLOCKWISE_TORCHAO_LIKE = dataclasses.replace(RECIPES["fp8_blockwise"], cache_fp8_input=False)
"""``fp8_blockwise`` as torchao's kernel computes it: wgrad quantises the saved bf16 X to 128x1
directly rather than re-quantising its FP8 1x128 copy."""

DEFAULT_FP8_FILTER_FQNS: tuple[str, ...] = ("output", "gate", "tok_embeddings")
"""Modules kept in high precision by name (DeepSeek-V3 section 3.3.1; see the module docstring).
An entry matches a module whose dotted FQN contains it as whole components (``"output"`` matches
``output``, not ``layers.0.output_proj``; ``"attention.wkv_b"`` works too)."""

Backend = Literal["auto", "torchao", "reference"]


# -- quantisation ------------------------------------------------------------------------------------


def _tiles(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """2-D ``t`` in fp32 as a [row groups, br, col groups, bc] view, zero-padded to whole groups
    (the zeros do not change any group's amax and are cropped afterwards)."""
    rows, cols = t.shape
    br, bc = block[0] or max(rows, 1), block[1] or max(cols, 1)
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    t32 = t.to(torch.float32)
    if nr * br != rows or nc * bc != cols:
        t32 = F.pad(t32, (0, nc * bc - cols, 0, nr * br - rows))
    return t32.contiguous().view(nr, br, nc, bc)


def _untile(tiles: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    nr, br, nc, bc = tiles.shape
    return tiles.view(nr * br, nc * bc)[: shape[0], : shape[1]]


def _quantize_tiles(tiles: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    nr, br, nc, bc = tiles.shape
    fmax = FP8_MAX[spec.dtype]
    # amax over dims (1, 3) of the 4-D view is a slow strided reduction on CPU; putting each
    # tile's elements last first is ~100x faster (it copies only for multi-row tiles)
    amax = tiles.permute(0, 2, 1, 3).reshape(nr, nc, br * bc).abs().amax(dim=-1)
    # torchao's formula, so that both give the same bits: the multiplier fp8_max / amax is
    # computed in float64 and rounded once to fp32, values are multiplied by it, and the
    # dequantisation scale is its fp32 reciprocal. (Dividing by an fp32 amax / fp8_max instead
    # changes ~2 FP8 values in 10^7, and the last bit of one scale in four.)
    multiplier = (fmax / amax.double().clamp_min(AMAX_EPS)).float()
    if spec.pow2_scales:  # rounded down: amax * multiplier stays <= fp8_max
        multiplier = torch.exp2(torch.floor(torch.log2(multiplier)))
    q = (tiles * multiplier[:, None, :, None]).clamp_(-fmax, fmax).to(spec.dtype)
    return q, multiplier.reciprocal()


def quantize_fp8(t: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``t`` -> (FP8 values of ``t``'s shape, fp32 scales [ceil(rows/br), ceil(k/bk)]) with
    ``t ~= q * scale``: per group, multiplier = fp32(fp8_max / float64(amax)) (rounded down to a
    power of two if the spec asks), ``t * multiplier`` clamped to +-fp8_max and cast
    (round-to-nearest-even), scale = fp32(1 / multiplier)."""
    q, scale = _quantize_tiles(_tiles(t, spec.block), spec)
    return _untile(q, t.shape), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`, in fp32."""
    return _untile(_tiles(q, block) * scale[:, None, :, None], q.shape)


def fake_quantize_fp8(t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``t`` as the FP8 GEMM sees it (quantised, then dequantised to fp32)."""
    q, scale = _quantize_tiles(_tiles(t, spec.block), spec)
    return _untile(q.to(torch.float32) * scale[:, None, :, None], t.shape)


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [m, k] @ b [n, k]^T`` in fp32, both operands made row-major ([m, k] and [k, n]) first:
    BLAS sums in an order that depends on the operands' layouts, and this is the layout torch's
    CPU ``_scaled_mm`` multiplies in, so the reference gives torchao's bits on CPU."""
    return a.contiguous() @ b.T.contiguous()


def _fp8_gemm(a: torch.Tensor, spec_a: QuantSpec, b: torch.Tensor, spec_b: QuantSpec) -> torch.Tensor:
    """``a [m, k] @ b[n, k]^T`` on FP8 operands with fp32 accumulation (exact products, fp32 sums)."""
    return _gemm(fake_quantize_fp8(a, spec_a), fake_quantize_fp8(b, spec_b))


def _check(recipe: Fp8Recipe, checks: bool, gemm: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """The GPU kernel's shape rule for this GEMM (:mod:`dsl_lit.precision.fp8_kernel_rules`)."""
    if checks:
        check_gemm(recipe.name, gemm, a.shape, b.shape)


class _Fp8LinearFunction(torch.autograd.Function):
    """``x @ weight^T`` with all three GEMMs on FP8 operands as the recipe says; ``x`` [..., in]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype, checks: bool):
        x2 = x.reshape(-1, x.shape[-1])
        _check(recipe, checks, "fprop", x2, weight)
        with torch.autocast(x.device.type, enabled=False):  # the fp32 GEMM must stay fp32
            xq, x_scale = quantize_fp8(x2, recipe.x)
            out = _gemm(dequantize_fp8(xq, x_scale, recipe.x.block), fake_quantize_fp8(weight, recipe.w))
        if recipe.cache_fp8_input:
            ctx.save_for_backward(xq, x_scale, weight)
        else:
            ctx.save_for_backward(x2, weight)
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.checks = recipe, x.shape, x.dtype, checks
        return out.to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        recipe: Fp8Recipe = ctx.recipe
        *saved, weight = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                _check(recipe, ctx.checks, "dgrad", dy, weight.T)
                grad_x = _fp8_gemm(dy, recipe.dy, weight.T, recipe.w_t).to(ctx.x_dtype).view(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                x2 = dequantize_fp8(saved[0], saved[1], recipe.x.block) if recipe.cache_fp8_input else saved[0]
                _check(recipe, ctx.checks, "wgrad", dy.T, x2.T)
                grad_w = _fp8_gemm(dy.T, recipe.dy_t, x2.T, recipe.x_t).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """What ``F.linear`` would return: the autocast dtype when autocast is on, else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    recipe: Fp8Recipe | str,
    bias: torch.Tensor | None = None,
    *,
    token_multiple: int = 1,
    checks: bool = True,
) -> torch.Tensor:
    """``F.linear`` with FP8 fprop/dgrad/wgrad per ``recipe`` (the pure-PyTorch reference path).

    ``checks``: refuse the shapes the GPU kernels refuse, with their messages
    (:func:`~dsl_lit.precision.fp8_kernel_rules.check_gemm`); ``token_multiple``: first zero-pad
    the tokens to a multiple of it (exact), which is how :class:`Fp8Linear` meets those rules."""
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    out_dtype = _out_dtype(x)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return _Fp8LinearFunction.apply(rows, weight, recipe, out_dtype, checks)

    out = call_with_padded_tokens(run, x, token_multiple)
    return out + bias.to(out.dtype) if bias is not None else out


# -- modules -----------------------------------------------------------------------------------------


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run on FP8 copies (reference path); ``weight`` stays the
    high-precision master parameter, so the state_dict is that of the ``nn.Linear``. Its tokens are
    zero-padded to ``token_multiple`` (the GPU kernels' rule, which the reference enforces)."""

    fp8_recipe: Fp8Recipe
    token_multiple: int = 1

    def __init__(self, *args, recipe: Fp8Recipe | str = "fp8_blockwise", pad_tokens: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._set_recipe(recipe, pad_tokens)

    def _set_recipe(self, recipe: Fp8Recipe | str, pad_tokens: bool) -> None:
        self.fp8_recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        self.token_multiple = token_multiple(self.fp8_recipe.name) if pad_tokens else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.fp8_recipe, self.bias, token_multiple=self.token_multiple)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.fp8_recipe.name}"

    @classmethod
    def convert(cls, linear: nn.Linear, recipe: Fp8Recipe | str, pad_tokens: bool = True) -> Fp8Linear:
        """Turn ``linear`` into this class in place (same object, parameters, hooks)."""
        linear.__class__ = cls
        linear._set_recipe(recipe, pad_tokens)  # type: ignore[attr-defined]
        return linear  # type: ignore[return-value]


class BlockwiseFp8Linear(Fp8Linear):
    """:class:`Fp8Linear` with DeepSeek-V3's blockwise recipe (1x128 activations, 128x128 weights)."""

    def __init__(self, *args, recipe: Fp8Recipe | str = "fp8_blockwise", **kwargs) -> None:
        super().__init__(*args, recipe=recipe, **kwargs)


class TokenPadding(nn.Module):
    """Mixed into torchao's FP8 Linears (:func:`_token_padded`): their kernels refuse token counts
    that are not multiples of 16 (``_scaled_mm``) or 128 (blockwise), so tokens are zero-padded."""

    token_multiple: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return call_with_padded_tokens(super().forward, x, self.token_multiple)


_padded_classes: dict[type, type] = {}


def _token_padded(module: nn.Module, multiple: int) -> None:
    """Give ``module`` (a torchao Linear) token padding by swapping its class in place: names,
    parameters and hooks stay."""
    base = type(module)
    if base not in _padded_classes:
        _padded_classes[base] = type(f"TokenPadded{base.__name__}", (TokenPadding, base), {})
    module.__class__ = _padded_classes[base]
    module.token_multiple = multiple


_warned_sharded: set[str] = set()


class Fp8GroupedExperts(GroupedExperts):
    """Routed experts whose matmuls run through the FP8 reference path, one GEMM per expert on
    its sorted tokens (the ``split`` backend's order); same parameters ``w1/w2/w3`` [E, out, in].
    Each expert's weight is its own 128x128-block (or per-row / per-tensor) quantised matrix, and
    its tokens form their own 128-token wgrad tiles, as in a grouped FP8 GEMM. Its token groups
    obey the rule of torchao's FP8 grouped GEMM (multiples of 16, which ``token_group_multiple``
    pads them to), not the per-Linear rules of the recipe: on a GPU the experts run there."""

    fp8_recipe: Fp8Recipe

    def __init__(self, *args, recipe: Fp8Recipe | str = "fp8_blockwise", pad_tokens: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._set_recipe(recipe, pad_tokens)

    def _set_recipe(self, recipe: Fp8Recipe | str, pad_tokens: bool) -> None:
        self.fp8_recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        self.token_group_multiple = GROUPED_MM_GROUP_MULTIPLE if pad_tokens else 1

    @torch.compiler.disable  # per-expert shapes are data: eager, as the split backend
    def run_groups(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outputs = []
        for e, chunk in enumerate(x.split(counts.tolist())):
            if chunk.shape[0]:
                outputs.append(self.expert(chunk, e))
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Expert parallelism re-registers sharded (DTensor) weights and then bypasses ``forward``:
        say so rather than silently losing FP8 for the routed experts."""
        if param is not None and name in ("w1", "w2", "w3") and type(param.data) is not torch.Tensor:
            recipe = getattr(self, "fp8_recipe", None)
            if recipe is not None and recipe.name not in _warned_sharded:
                _warned_sharded.add(recipe.name)
                log.warning(
                    "apply_fp8(%s): routed experts were sharded after apply_fp8 (expert parallelism); its "
                    "dispatch bypasses Fp8GroupedExperts, so they run in high precision", recipe.name,
                )
        super().register_parameter(name, param)

    def expert(self, h: torch.Tensor, e: int) -> torch.Tensor:
        check_token_groups([h.shape[0]])
        r = self.fp8_recipe

        def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return fp8_linear(a, w[e], r, checks=False)  # the grouped GEMM's rule, checked above

        return linear(F.silu(linear(h, self.w1)) * linear(h, self.w3), self.w2)

    @classmethod
    def convert(cls, experts: GroupedExperts, recipe: Fp8Recipe | str, pad_tokens: bool = True) -> Fp8GroupedExperts:
        experts.__class__ = cls
        experts._set_recipe(recipe, pad_tokens)  # type: ignore[attr-defined]
        return experts  # type: ignore[return-value]


# -- choosing and swapping ---------------------------------------------------------------------------


def _filtered(fqn: str, filter_fqns: Iterable[str]) -> bool:
    return any(f".{entry}." in f".{fqn}." for entry in filter_fqns)


def fp8_targets(
    model: nn.Module,
    recipe: str,
    filter_fqns: Iterable[str] = DEFAULT_FP8_FILTER_FQNS,
    include_experts: bool = True,
) -> tuple[list[tuple[str, nn.Linear]], list[tuple[str, GroupedExperts]]]:
    """The (fqn, module) pairs ``apply_fp8`` would swap: plain ``nn.Linear`` s and
    ``GroupedExperts`` not filtered by name, with dims multiples of the recipe's ``dim_multiple``."""
    r = _recipe(recipe)
    filter_fqns = tuple(filter_fqns)
    linears: list[tuple[str, nn.Linear]] = []
    experts: list[tuple[str, GroupedExperts]] = []
    for fqn, module in model.named_modules():
        if _filtered(fqn, filter_fqns):
            continue
        if type(module) is nn.Linear:  # exact type: already-swapped modules are skipped
            dims_ok = module.in_features % r.dim_multiple == 0 and module.out_features % r.dim_multiple == 0
            if dims_ok and (r.allows_bias or module.bias is None):
                linears.append((fqn, module))
        elif type(module) is GroupedExperts and include_experts:
            hidden, dim = module.w1.shape[-2:]
            if hidden % r.dim_multiple or dim % r.dim_multiple:
                continue
            if any(type(getattr(module, n).data) is not torch.Tensor for n in ("w1", "w2", "w3")):
                log.warning(
                    "apply_fp8(%s): %s has sharded or wrapped weights (expert parallelism or torchao "
                    "already applied); its routed experts stay as they are", r.name, fqn,
                )
                continue
            experts.append((fqn, module))
    return linears, experts


def _recipe(recipe: str) -> Fp8Recipe:
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {FP8_RECIPES}")
    return RECIPES[recipe]


def torchao_unavailable_reason(recipe: str, experts: bool = False, expert_backend: str = "grouped_mm") -> str | None:
    """Why torchao's FP8 training cannot run ``recipe`` here (for Linears, or for routed experts run
    by ``expert_backend``); ``None`` when it can. Without CUDA, torchao's tensorwise / rowwise
    Linears still run (torch's CPU ``_scaled_mm``), and so do its experts under ``split`` / ``loop``
    (one ``F.linear`` per expert); its blockwise and grouped FP8 kernels are Triton (CUDA only)."""
    if torch.cuda.is_available():
        need = (8, 9) if recipe == "fp8_tensorwise" and not experts else (9, 0)
        capability = torch.cuda.get_device_capability()
        if capability < need:
            return f"needs a GPU of compute capability {need[0]}.{need[1]}+, found {capability[0]}.{capability[1]}"
    elif experts and expert_backend == "grouped_mm":
        return "its FP8 grouped GEMM is a Triton kernel and CUDA is not available (expert_backend=split or loop runs on CPU)"
    elif recipe == "fp8_blockwise" and not experts:
        return "its blockwise FP8 kernels are Triton kernels and CUDA is not available"
    try:
        if experts:  # the names used below; older torchao releases lack some of them
            from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: F401
            from torchao.quantization import quantize_  # noqa: F401
        elif recipe == "fp8_blockwise":
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear  # noqa: F401
        else:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as error:  # ImportError, or a torchao built against another torch
        return (
            f"torchao does not provide it ({type(error).__name__}: {error}); "
            "pip install 'dsl-lit[fp8]' (torchao 0.18 has every path used here)"
        )
    return None


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _torchao_linears(model: nn.Module, recipe: str, linears: list[tuple[str, nn.Linear]], pad_tokens: bool) -> None:
    names = [fqn for fqn, _ in linears]
    if recipe == "fp8_blockwise":
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        for fqn, module in linears:
            _set_submodule(model, fqn, Float8BlockwiseLinear.from_float(module))
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe.removeprefix("fp8_"))
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _module, fqn: fqn in set(names))
    if pad_tokens:
        for fqn in names:
            _token_padded(model.get_submodule(fqn), token_multiple(recipe))


def _torchao_experts(model: nn.Module, experts: list[tuple[str, GroupedExperts]], pad_tokens: bool) -> None:
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    names = {fqn for fqn, _ in experts}
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda _module, fqn: fqn in names)
    if pad_tokens:  # torchao 0.18's grouped GEMM does not pad token groups itself (it asserts)
        for _, module in experts:
            module.token_group_multiple = GROUPED_MM_GROUP_MULTIPLE


def _choose(recipe: str, part: str, backend: Backend, experts: bool, expert_backend: str = "grouped_mm") -> bool:
    """True for torchao, False for the reference path; logs every fallback. ``"auto"`` takes torchao
    on CUDA only: on CPU torchao computes what the reference does (the same bits, oneDNN aside),
    no faster."""
    if backend == "reference":
        log.info("apply_fp8(%s): %s use the pure-PyTorch reference path (backend='reference')", recipe, part)
        return False
    if backend == "auto" and not torch.cuda.is_available():
        reason: str | None = "CUDA is not available"
    else:
        reason = torchao_unavailable_reason(recipe, experts=experts, expert_backend=expert_backend)
    if reason is None:
        return True
    if backend == "torchao":
        raise RuntimeError(f"apply_fp8({recipe}, backend='torchao'): torchao cannot run the {part}: {reason}")
    log.warning(
        "apply_fp8(%s): torchao FP8 training is unavailable for the %s (%s); using the pure-PyTorch "
        "reference path (same FP8 numerics, fp32 GEMMs, slower than bf16)", recipe, part, reason,
    )
    return False


def apply_fp8(
    model: nn.Module,
    recipe: str,
    filter_fqns: Iterable[str] = DEFAULT_FP8_FILTER_FQNS,
    *,
    include_experts: bool = True,
    backend: Backend = "auto",
    pad_tokens: bool = True,
) -> int:
    """Swap ``model``'s eligible Linears (and routed experts unless ``include_experts=False``) to
    FP8 training per ``recipe`` (one of ``FP8_RECIPES``), in place; returns how many modules were
    swapped (a ``GroupedExperts`` counts once). Call it before wrapping the model for parallelism
    and before ``torch.compile``.

    ``filter_fqns``: modules kept in high precision by name (default ``DEFAULT_FP8_FILTER_FQNS``).
    ``backend``: ``"auto"`` (torchao on a GPU that supports it, else the reference path with a
    warning), ``"torchao"`` (torchao wherever it runs, CPU included; raise where it cannot) or
    ``"reference"`` (always the reference). Every choice is made before any module is swapped.
    ``pad_tokens``: zero-pad each FP8 Linear's tokens, and each routed expert's token group, to the
    multiple the GPU kernels need (:mod:`dsl_lit.precision.fp8_kernel_rules`; exact). Off, a
    batch whose token count breaks a rule fails as it would on the GPU, on CPU too.
    """
    r = _recipe(recipe)
    if backend not in ("auto", "torchao", "reference"):
        raise ValueError(f"backend={backend!r}; choose 'auto', 'torchao' or 'reference'")
    linears, experts = fp8_targets(model, recipe, filter_fqns, include_experts)
    torchao_linears = bool(linears) and _choose(recipe, "Linear layers", backend, experts=False)
    groups: dict[str, list[tuple[str, GroupedExperts]]] = {}
    for fqn, module in experts:
        groups.setdefault(module.backend, []).append((fqn, module))
    torchao_experts = {
        name: _choose(recipe, f"routed experts (expert_backend={name})", backend, experts=True, expert_backend=name)
        for name in groups
    }
    if torchao_linears:
        _torchao_linears(model, recipe, linears, pad_tokens)
    else:
        for _, module in linears:
            (BlockwiseFp8Linear if r.name == "fp8_blockwise" else Fp8Linear).convert(module, r, pad_tokens)
    for name, group in groups.items():
        if not torchao_experts[name]:
            for _, module in group:
                Fp8GroupedExperts.convert(module, r, pad_tokens)
            continue
        if recipe != "fp8_rowwise":
            log.warning(
                "apply_fp8(%s): torchao's MoE training offers rowwise FP8 only; the routed experts use "
                "rowwise scaling", recipe,
            )
        _torchao_experts(model, group, pad_tokens)
    log.info(
        "apply_fp8(%s): %d Linear layers and %d routed-expert modules in FP8",
        recipe, len(linears), len(experts),
    )
    return len(linears) + len(experts)
