"""Per-GPU memory of a training step, counted tensor by tensor.

Model state, per parameter on the GPU (which parameters live where follows the layout: tp shards
attention, dense FFNs, shared experts, embedding and head; ep shards routed experts; pp places
layers with :func:`dsl_lit.parallel.pipeline.split_layers`; DualPipe holds two stages per rank):
weights (4 bytes in fp32 training, else 2), gradients (4: fp32 accumulation), fp32 master weights
(outside fp32 training) and AdamW's two moments or Muon's one momentum (fp32 or bf16); ZeRO-1 divides master and moments
by the number of ranks holding a replica (dp, or dp / ep for routed experts).

Activations: what backward keeps per token and block, listed from our blocks' code (the inputs
autograd saves for each matmul, norm, activation and attention call) for each recompute mode
(:mod:`dsl_lit.memory.recompute`): ``none`` keeps them all, ``selective`` keeps the outputs of
matmuls and attention (norms, activations and rotary are recomputed), ``full`` keeps each block's
input; the planner-only ``deepseek_v3`` is DeepSeek-V3's recipe (:func:`deepseek_v3_activations`).
Times the micro-batches a pipeline schedule keeps in flight on a rank (1F1B: pp,
DualPipe pp + 1 stage-micro-batches), plus the output logits of one micro-batch on the last stage,
one block's full working set for the backward in progress, and MoE dispatch/combine buffers.

Not counted: an EMA of the weights (DeepSeek-V3 keeps it in CPU memory), FP8 copies of weights
(quantised per GEMM, one layer's worth at a time, inside the working set's margin).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.pipeline_schedules import schedule, stages_of_rank
from dsl_lit.flops import attention_params
from dsl_lit.parallel.pipeline import split_layers
from dsl_lit.scaling.planner.attention_costs import attention_costs
from dsl_lit.scaling.planner.cluster import GIB, ClusterConfig
from dsl_lit.scaling.planner.layout import V3_RECIPE, PlanLayout

FP32 = 4
FP8_TILE = 1 + FP32 / 128
"""An FP8 (E4M3) element plus its share of the fp32 scale of its 1x128 tile (DeepSeek-V3 3.3.2)."""
E5M6_TILE = 1.5 + FP32 / 128
"""DeepSeek-V3 caches the attention output (wo's input, also read by attention's backward) in its
12-bit E5M6 format, same tiles (section 3.3.2 (1))."""


def compute_bytes(layout: PlanLayout) -> int:
    """Bytes of an activation element: fp32 training keeps fp32, everything else bf16/fp16
    (FP8 GEMMs take bf16 activations and quantise them on the fly)."""
    return FP32 if layout.precision == "fp32" else 2


# -- parameters -------------------------------------------------------------------------------------
@dataclass
class ParamCounts:
    """Parameters on one GPU, by how they are replicated."""

    dense: float = 0.0  # replicated over dp (sharded over tp where the plan shards them)
    experts: float = 0.0  # routed experts: replicated over dp / ep

    def __add__(self, other: ParamCounts) -> ParamCounts:
        return ParamCounts(self.dense + other.dense, self.experts + other.experts)


def block_params(cfg: ModelConfig, layer_id: int, layout: PlanLayout) -> ParamCounts:
    """One block's parameters on one GPU (``layer_id >= n_layers``: an MTP block)."""
    tp = layout.parallel.tp
    norms = 2 * cfg.d_model + attention_costs(cfg).norm_params(cfg)
    dense = attention_params(cfg) / tp + norms
    if cfg.is_moe_layer(layer_id):
        dense += cfg.d_model * cfg.n_routed_experts + 3 * cfg.d_model * cfg.moe_ffn_hidden * cfg.n_shared_experts / tp
        routed = 3 * cfg.d_model * cfg.moe_ffn_hidden * cfg.n_routed_experts
        return ParamCounts(dense, routed / (layout.parallel.ep if layout.parallel.ep > 1 else tp))
    return ParamCounts(dense + 3 * cfg.d_model * cfg.ffn_hidden / tp, 0.0)


def stage_layers_of(cfg: ModelConfig, layout: PlanLayout) -> list[list[int]]:
    return split_layers(cfg, layout.n_stages) if layout.parallel.pp > 1 else [list(range(cfg.n_layers))]


def stages_on_rank(rank: int, layout: PlanLayout) -> list[int]:
    if layout.parallel.pp == 1:
        return [0]
    return stages_of_rank(rank, layout.parallel.pp, layout.chunks_per_rank, layout.parallel.pp_schedule)


def stage_params(cfg: ModelConfig, layout: PlanLayout, layers: list[int], first: bool, last: bool) -> ParamCounts:
    counts = ParamCounts()
    for i in layers:
        counts = counts + block_params(cfg, i, layout)
    vocab = cfg.d_model * cfg.vocab_size / layout.parallel.tp
    if first:
        counts.dense += vocab
    if last:
        counts.dense += cfg.d_model + (0 if cfg.tie_embeddings else vocab)
        for k in range(cfg.mtp_modules):
            mtp = block_params(cfg, cfg.n_layers + k, layout)
            counts = counts + ParamCounts(mtp.dense + 2 * cfg.d_model**2 + 3 * cfg.d_model, mtp.experts)
    return counts


def rank_params(cfg: ModelConfig, layout: PlanLayout, rank: int) -> ParamCounts:
    """Parameters held by pp rank ``rank`` (all its stages)."""
    stage_layers = stage_layers_of(cfg, layout)
    last = len(stage_layers) - 1
    counts = ParamCounts()
    for s in stages_on_rank(rank, layout):
        counts = counts + stage_params(cfg, layout, stage_layers[s], s == 0, s == last)
    return counts


def optimizer_shard(params: ParamCounts, layout: PlanLayout) -> float:
    """Parameters whose master weights and moments this GPU keeps: ZeRO-1 divides each by the
    ranks holding a replica (dp; dp / ep for routed experts; twice that under DualPipe, whose
    stages live on two ranks)."""
    if not layout.parallel.zero1:
        return params.dense + params.experts
    copies = schedule(layout.parallel.pp_schedule).copies_per_stage
    return params.dense / (layout.parallel.dp * copies) + params.experts / (max(1, layout.parallel.dp // layout.parallel.ep) * copies)


# -- activations ------------------------------------------------------------------------------------
def routed_shape(cfg: ModelConfig, layout: PlanLayout) -> tuple[float, float]:
    """(routed copies per token of the micro-batch, expert hidden width) on one GPU. Without
    expert parallelism every tp rank runs all k copies on its 1/tp of each expert; with it the
    experts are whole and the tp ranks split the tokens (Megatron-Core's expert-TP 1 under sequence
    parallelism), k / tp copies each, as the matmul FLOPs (divided by tp) already assume."""
    k, tp = cfg.n_activated_experts, layout.parallel.tp
    if layout.parallel.ep > 1:
        return k / tp, float(cfg.moe_ffn_hidden)
    return float(k), cfg.moe_ffn_hidden / tp


def attention_activations(cfg: ModelConfig, mode: str, tp: int, sp: bool) -> float:
    """Elements per token one attention sub-block keeps for backward (block input included)."""
    d = cfg.d_model / (tp if sp else 1)
    h = cfg.n_heads / tp
    if mode == "full":
        return d
    return attention_costs(cfg).activation_elements(cfg, mode, h, d, tp)


def ffn_activations(cfg: ModelConfig, layer_id: int, mode: str, layout: PlanLayout, dtype_bytes: int) -> float:
    """Elements per token one FFN sub-block keeps (the residual stream at its input included)."""
    tp, sp = layout.parallel.tp, layout.parallel.sequence_parallel
    d = cfg.d_model / (tp if sp else 1)
    if mode == "full":
        return 0.0  # the block's input is counted once, with attention
    if not cfg.is_moe_layer(layer_id):
        f = cfg.ffn_hidden / tp
        # selective: w1, w3 and w2 outputs; none: h, norm output, w1, silu, w3, product
        return 2 * f + d if mode == "selective" else 2 * d + 4 * f
    e = cfg.n_routed_experts
    k, f_routed = routed_shape(cfg, layout)
    f_shared = cfg.n_shared_experts * cfg.moe_ffn_hidden / tp
    router = 3 * e * FP32 / dtype_bytes  # fp32 logits, scores, biased scores
    if mode == "selective":  # router logits; grouped w1/w3, w2 outputs; shared w1/w3, w2 outputs
        return e * FP32 / dtype_bytes + k * (2 * f_routed + cfg.d_model) + 2 * f_shared + d
    # h, norm output, router; per routed copy: dispatched input, w1, silu, w3, product, output;
    # shared experts as a dense SwiGLU
    return 2 * d + router + k * (2 * cfg.d_model + 4 * f_routed) + 4 * f_shared


def deepseek_v3_activations(cfg: ModelConfig, layer_id: int, layout: PlanLayout) -> float:
    """Bytes per token one block keeps under DeepSeek-V3's recipe (arXiv 2412.19437 sections 3.2.3
    and 3.3.2), tensor by tensor:

    - every RMSNorm is recomputed: each sub-block keeps its input (the residual stream), not the
      norm's output;
    - MLA up-projections are recomputed: attention keeps the latents they start from (the query
      latent, the kv latent with the shared rotary key) and rebuilds q, k, v for attention's
      backward; without a query latent (``q_lora_rank`` null) the queries are kept; GQA keeps q, k, v;
    - the attention output (wo's input) is kept, in E5M6 under FP8, plus fp32 softmax statistics;
    - SwiGLU inputs (w1, w3 outputs) are kept, in FP8 under FP8, and its output recomputed;
    - routed experts keep their dispatched input (FP8 under FP8: V3 dispatches FP8) per copy, the
      router its fp32 scores and the top-k weights and indices. Assumed, as the paper does not
      say: the combine weight scales the SwiGLU output before w2 on the expert's rank, so its
      gradient comes from tensors already kept and expert outputs are not stored.

    Without FP8 the same tensors are kept in the compute dtype."""
    tp, sp = layout.parallel.tp, layout.parallel.sequence_parallel
    act = compute_bytes(layout)
    fp8 = layout.precision == "fp8"
    linear_in, attention_out = (FP8_TILE, E5M6_TILE) if fp8 else (act, act)
    d = cfg.d_model / (tp if sp else 1)
    h = cfg.n_heads / tp
    kept, out = attention_costs(cfg).recipe_kept_elements(cfg, h, tp)
    attention = (d + kept) * act + out * attention_out + h * FP32
    ffn = d * act
    if not cfg.is_moe_layer(layer_id):
        return attention + ffn + 2 * cfg.ffn_hidden / tp * linear_in
    k, f_routed = routed_shape(cfg, layout)
    f_shared = cfg.n_shared_experts * cfg.moe_ffn_hidden / tp
    ffn += cfg.n_routed_experts * FP32 + cfg.n_activated_experts * (FP32 + 8)  # scores; top-k weights (fp32) and indices (int64)
    ffn += k * (cfg.d_model + 2 * f_routed) * linear_in + 2 * f_shared * linear_in
    return attention + ffn


def block_activations(cfg: ModelConfig, layer_id: int, mode: str, layout: PlanLayout) -> float:
    """Bytes per token one block keeps for backward under ``mode``."""
    if mode == V3_RECIPE:
        return deepseek_v3_activations(cfg, layer_id, layout)
    size = compute_bytes(layout)
    elements = attention_activations(cfg, mode, layout.parallel.tp, layout.parallel.sequence_parallel)
    elements += ffn_activations(cfg, layer_id, mode, layout, size)
    return elements * size


def in_flight(rank: int, layout: PlanLayout) -> float:
    """Chunk-micro-batches whose activations rank ``rank`` holds at its peak.

    1F1B / ZB1P: pp - rank warm-up micro-batches; GPipe: all m; Interleaved1F1B with v chunks:
    Megatron's pp v + pp - 1 - 2 rank; DualPipe: pp + 1 stage-micro-batches (DeepSeek-V3's table),
    DualPipeV: 2 pp + 1 half-stage chunks (the same table with PP = 2 pp stages)."""
    pp, m, v = layout.parallel.pp, layout.micro_batches, layout.chunks_per_rank
    if pp == 1:
        return 1.0
    return float(IN_FLIGHT[layout.parallel.pp_schedule](pp, m, v, rank))


IN_FLIGHT: dict[str, Callable[[int, int, int, int], int]] = {
    "GPipe": lambda pp, m, v, rank: m * v,
    "1F1B": lambda pp, m, v, rank: min(m, pp - rank),
    "ZB1P": lambda pp, m, v, rank: min(m, pp - rank),
    "Interleaved1F1B": lambda pp, m, v, rank: min(m * v, pp * v + pp - 1 - 2 * rank),
    "DualPipe": lambda pp, m, v, rank: min(m, pp + 1),
    "DualPipeV": lambda pp, m, v, rank: min(m * v, 2 * pp + 1),
}
"""(pp, micro-batches, chunks per rank, pp rank) -> chunk-micro-batches held at the peak, per row of
:data:`~dsl_lit.config.pipeline_schedules.SCHEDULE_TABLE` (see :func:`in_flight`; a test ties the two)."""


def moe_buffers(cfg: ModelConfig, layout: PlanLayout) -> float:
    """Bytes of the all-to-all buffers in use: one micro-batch's k copies per token received by
    dispatch (FP8 under FP8) and sent back by combine (compute dtype); DualPipe and DualPipeV
    run a forward and a backward chunk's all-to-alls at once (so does any layout with
    ``ep_overlap``), so twice that."""
    tokens = layout.micro_batch_size * layout.seq_len
    dispatch = FP8_TILE if layout.precision == "fp8" else compute_bytes(layout)
    overlapped = layout.overlaps_all_to_all
    copies = tokens * routed_shape(cfg, layout)[0] * cfg.d_model
    return copies * (dispatch + compute_bytes(layout)) * (2 if overlapped else 1)


@dataclass
class MemoryEstimate:
    """Bytes on the busiest GPU (the pp rank with the largest total)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    working: float
    """One block's full activations for the backward in progress, plus MoE dispatch buffers."""
    reserved: float
    pp_rank: int
    params_on_gpu: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.working + self.reserved

    def gib(self) -> dict[str, float]:
        parts = {k: v / GIB for k, v in asdict(self).items() if k not in ("pp_rank", "params_on_gpu")}
        return {**parts, "total": self.total / GIB}


def estimate_memory(cfg: ModelConfig, layout: PlanLayout, cluster: ClusterConfig | None = None) -> MemoryEstimate:
    """Per-GPU memory of the busiest pp rank (``cluster`` adds its reserved memory and the
    allocator's fragmentation; None: the bare tensors, as on CPU)."""
    stage_layers = stage_layers_of(cfg, layout)
    last = len(stage_layers) - 1
    tokens = layout.micro_batch_size * layout.seq_len
    size = compute_bytes(layout)
    fp32 = layout.precision == "fp32"
    master_bytes = 0 if fp32 else FP32
    moments = 1 if layout.optimizer == "muon" else 2
    moment_bytes = moments * (FP32 if layout.moments_dtype == "fp32" else 2)
    estimates = []
    for rank in range(layout.parallel.pp):
        stages = stages_on_rank(rank, layout)
        params = rank_params(cfg, layout, rank)
        n = params.dense + params.experts
        optimizer = (master_bytes + moment_bytes) * optimizer_shard(params, layout)
        per_chunk = [sum(block_activations(cfg, i, layout.recompute, layout) for i in stage_layers[s]) for s in stages]
        activations = in_flight(rank, layout) * tokens * sum(per_chunk) / len(per_chunk)
        holds_last = last in stages
        depth = cfg.mtp_modules
        logits = 0.0
        if holds_last:
            head = tokens * cfg.vocab_size / layout.parallel.tp * size * (1 + depth)
            mtp = sum(tokens * block_activations(cfg, cfg.n_layers + k, layout.recompute, layout) for k in range(depth))
            logits = head + mtp + tokens * 2 * cfg.d_model * size  # final norm input and output
        rank_layers = [i for s in stages for i in stage_layers[s]]
        working = tokens * max(block_activations(cfg, i, "none", layout) for i in rank_layers)
        if cfg.is_moe:
            working += moe_buffers(cfg, layout)
        estimates.append(MemoryEstimate(
            weights=n * (FP32 if fp32 else 2), gradients=n * FP32, optimizer=optimizer, activations=activations,
            logits=logits, working=working, reserved=0.0, pp_rank=rank, params_on_gpu=n,
        ))
    busiest = max(estimates, key=lambda e: e.total)
    if cluster is not None:
        busiest.reserved = cluster.reserved_gib * GIB + cluster.efficiency.fragmentation * busiest.total
    return busiest
