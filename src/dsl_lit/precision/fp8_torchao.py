"""torchao's FP8 training behind ``apply_fp8``: whether it can run a recipe here, the swap of Linears
and routed experts to its modules, and the token padding its kernels need (see ``fp8.py``)."""

from __future__ import annotations

import torch
from torch import nn

from dsl_lit.config.fp8_recipes import EXPERTS_MIN_CAPABILITY, FP8_RECIPES
from dsl_lit.models.common.moe import GroupedExperts
from dsl_lit.models.common.token_padding import call_with_padded_tokens
from dsl_lit.precision.fp8_kernel_rules import GROUPED_MM_GROUP_MULTIPLE, token_multiple


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


def torchao_unavailable_reason(recipe: str, experts: bool = False, expert_backend: str = "grouped_mm") -> str | None:
    """Why torchao's FP8 training cannot run ``recipe`` here (for Linears, or for routed experts run
    by ``expert_backend``); ``None`` when it can. Without CUDA, torchao's tensorwise / rowwise
    Linears still run (torch's CPU ``_scaled_mm``), and so do its experts under ``split`` / ``loop``
    (one ``F.linear`` per expert); its blockwise and grouped FP8 kernels are Triton (CUDA only)."""
    row = FP8_RECIPES[recipe]
    if torch.cuda.is_available():
        need = EXPERTS_MIN_CAPABILITY if experts else row.min_capability
        capability = torch.cuda.get_device_capability()
        if capability < need:
            return f"needs a GPU of compute capability {need[0]}.{need[1]}+, found {capability[0]}.{capability[1]}"
    elif experts and expert_backend == "grouped_mm":
        return "its FP8 grouped GEMM is a Triton kernel and CUDA is not available (expert_backend=split or loop runs on CPU)"
    elif row.torchao_linear == "blockwise" and not experts:
        return "its blockwise FP8 kernels are Triton kernels and CUDA is not available"
    try:
        if experts:  # the names used below; older torchao releases lack some of them
            from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: F401
            from torchao.quantization import quantize_  # noqa: F401
        elif row.torchao_linear == "blockwise":
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
    row = FP8_RECIPES[recipe]
    if row.torchao_linear == "blockwise":
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        for fqn, module in linears:
            _set_submodule(model, fqn, Float8BlockwiseLinear.from_float(module))
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(row.torchao_linear.removeprefix("float8:"))
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
