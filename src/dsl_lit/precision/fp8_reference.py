"""The pure-PyTorch reference path of FP8 training: the Linear's three GEMMs on FP8 operands with
fp32 accumulation (a custom autograd function), the module swaps that use it, and routed experts.
It checks the GPU kernels' shape rules (``fp8_kernel_rules``) so that CPU runs fail where GPU runs
would, and pads tokens so that they hold (see ``fp8.py``)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from dsl_lit.models.common.layers import gated_silu
from dsl_lit.models.common.moe import GroupedExperts
from dsl_lit.models.common.token_padding import call_with_padded_tokens
from dsl_lit.precision.fp8_kernel_rules import (
    GROUPED_MM_GROUP_MULTIPLE,
    check_gemm,
    check_token_groups,
    token_multiple,
)
from dsl_lit.precision.fp8_quantize import QuantSpec, dequantize_fp8, fake_quantize_fp8, quantize_fp8
from dsl_lit.precision.fp8_recipes import Fp8Recipe, recipe_named

log = logging.getLogger("dsl_lit.precision.fp8")


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
    recipe = recipe_named(recipe) if isinstance(recipe, str) else recipe
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
        self.fp8_recipe = recipe_named(recipe) if isinstance(recipe, str) else recipe
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
        self.fp8_recipe = recipe_named(recipe) if isinstance(recipe, str) else recipe
        self.token_group_multiple = GROUPED_MM_GROUP_MULTIPLE if pad_tokens else 1

    @torch.compiler.disable  # per-expert shapes are data: eager, as the split backend
    def run_groups(self, x: torch.Tensor, counts: torch.Tensor, aligned_to: int = 1) -> torch.Tensor:
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

        return linear(gated_silu(linear(h, self.w1), linear(h, self.w3), self.limit), self.w2)

    @classmethod
    def convert(cls, experts: GroupedExperts, recipe: Fp8Recipe | str, pad_tokens: bool = True) -> Fp8GroupedExperts:
        experts.__class__ = cls
        experts._set_recipe(recipe, pad_tokens)  # type: ignore[attr-defined]
        return experts  # type: ignore[return-value]
