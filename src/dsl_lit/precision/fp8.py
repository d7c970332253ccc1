"""FP8 training as a module swap applied to a built model from outside (the models stay plain PyTorch).

Files: this one chooses the modules and the backend (``apply_fp8``); ``fp8_quantize`` quantises,
``fp8_recipes`` says how each GEMM operand is scaled, ``fp8_reference`` is the pure-PyTorch path,
``fp8_torchao`` the adapter to torchao's kernels, ``fp8_kernel_rules`` the kernels' shape rules.

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

The reference path against torchao 0.18 on CPU (tests/unit/precision/test_fp8_torchao.py; oneDNN off, so that torch's
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

Measured on CPU (tests/unit/precision/test_fp8.py, benchmarks/fp8_reference_error.py): the FP8 values equal a
float64 emulation of this arithmetic bit for bit (dequantised values to one fp32 rounding), the
Linear's three GEMMs match a float64 emulation of the recipe to ~4e-7 and are ~3.7% off fp32
(bf16: 0.24%), and five AdamW steps of ``deepseek_v3_tiny`` under ``fp8_blockwise`` end within
0.3-1.1% of the fp32 loss (seeds 0-5).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

from dsl_lit.config.fp8_recipes import FP8_RECIPES as FP8_TABLE
from dsl_lit.models.common.moe import GroupedExperts
from dsl_lit.precision.fp8_quantize import (  # noqa: F401 (the public names, importable from here)
    AMAX_EPS,
    E4M3,
    E5M2,
    FP8_MAX,
    QuantSpec,
    dequantize_fp8,
    fake_quantize_fp8,
    quantize_fp8,
)
from dsl_lit.precision.fp8_recipes import (  # noqa: F401
    BLOCKWISE_TORCHAO_LIKE,
    FP8_RECIPES,
    RECIPES,
    Fp8Recipe,
    recipe_named,
)
from dsl_lit.precision.fp8_reference import (  # noqa: F401
    BlockwiseFp8Linear,
    Fp8GroupedExperts,
    Fp8Linear,
    fp8_linear,
)
from dsl_lit.precision.fp8_torchao import (  # noqa: F401
    TokenPadding,
    _torchao_experts,
    _torchao_linears,
    torchao_unavailable_reason,
)

log = logging.getLogger(__name__)

DEFAULT_FP8_FILTER_FQNS: tuple[str, ...] = ("output", "gate", "tok_embeddings")
"""Modules kept in high precision by name (DeepSeek-V3 section 3.3.1; see the module docstring).
An entry matches a module whose dotted FQN contains it as whole components (``"output"`` matches
``output``, not ``layers.0.output_proj``; ``"attention.wkv_b"`` works too)."""

Backend = Literal["auto", "torchao", "reference"]


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
    return recipe_named(recipe)


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
            (BlockwiseFp8Linear if r.kernel == "blockwise" else Fp8Linear).convert(module, r, pad_tokens)
    for name, group in groups.items():
        if not torchao_experts[name]:
            for _, module in group:
                Fp8GroupedExperts.convert(module, r, pad_tokens)
            continue
        if not FP8_TABLE[recipe].experts_rowwise:
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
