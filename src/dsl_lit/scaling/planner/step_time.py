"""Time of one optimizer step on the busiest pipeline rank, from FLOPs, bytes and bandwidths.

Per micro-batch and rank, forward F and backward B add up

- matmuls: 2 (forward) and 4 (backward) FLOPs per activated weight and token, at the GEMM peak of
  the layout's precision times ``efficiency.gemm`` (``fp8_gemm`` for the blocks' linears under
  FP8; the head stays bf16, as in DeepSeek-V3), the routed experts' grouped GEMMs at
  ``efficiency.grouped_gemm`` of that; W, the weight-gradient half of B, equals the forward matmul
  time;
- attention scores and values: the causal half of ``dsl_lit.flops``' count (kernels skip masked
  tiles), forward once, backward 2.5x (flash attention recomputes the scores), at
  ``efficiency.attention``;
- memory-bound work (norms, activations, rotary, residuals, MoE permutation):
  ``efficiency.activation_passes`` HBM passes over the bytes backward keeps without recompute, a
  quarter in forward;
- FP8 casts (``precision=fp8``): DeepSeek-V3 quantises in kernels of their own (section 3.5.2:
  BF16 read from HBM, FP8 written back, read again by the GEMM; for the weight gradient the cached
  1x128 tiles are read, transposed and re-quantised to 128x1): per token and linear, its input is
  quantised in forward (2 + 1 bytes per element) and re-tiled in backward (1 + 1), its output
  gradient quantised for both GEMMs of backward (2 + 1 + 1); at ``efficiency.hbm``;
- recompute: ``selective`` and ``deepseek_v3`` repeat the forward's memory-bound work (norms,
  activations) in backward, ``deepseek_v3`` also the MLA up-projections' GEMMs; ``full`` runs each
  block's forward again;
- tensor parallelism: two all-reduces of the hidden states per block in forward and two in
  backward (ring: 2 (tp-1)/tp of the bytes), over NVLink inside a node, ``tp_overlap`` hidden.

Communication beyond that:

- expert parallelism: dispatch (FP8 under FP8 training, else bf16) and combine (bf16) all-to-alls,
  forward and backward, of k copies per token (each tp rank dispatches its 1/tp of the tokens);
  across nodes, node-limited routing sends one copy per destination node over InfiniBand
  (DeepSeek-V3 section 3.2.2: at most ``n_limited_groups`` nodes; ``plan.routed_nodes`` when a
  benchmark's router sends fewer) and NVLink forwards it. DualPipe and DualPipeV overlap a chunk's
  all-to-all with the paired chunk's compute (only what exceeds that compute shows), at the price of
  ``cluster.comm_sms`` SMs taken from compute, and so does any schedule with ``plan.ep_overlap``
  (Megatron-Core's 1F1B all-to-all overlap); other schedules wait for it;
- pipeline sends of one micro-batch's hidden states per stage boundary, 1/tp of them per tp rank
  (hidden under DualPipe and with ``plan.ep_overlap``);
- data parallelism: ZeRO-1 reduce-scatters gradients (fp32) during the last micro-batch's backward
  (only the excess shows) and all-gathers updated weights after the step; without ZeRO-1 one
  all-reduce. Routed experts' gradients reduce over dp / ep ranks;
- the optimizer step itself: memory-bound over this rank's ZeRO shard.

Pipeline bubbles (DeepSeek-V3 report table 2 and the zero-bubble paper, per-chunk F, B, W): GPipe and 1F1B (pp-1)(F+B); Interleaved1F1B
(pp-1)(F+B)/v; ZB1P (pp-1)(F+B-2W); DualPipe (pp/2-1)(F&B+B-3W) with F&B = F+B; DualPipeV the
same with its 2 pp half-size stages.

Not modelled: expert load imbalance (the bias-based balancing keeps it near 1; published benchmarks
force balance), smaller GEMMs' lower efficiency at small micro-batches, stragglers, failures and
restarts. :mod:`.published` holds the model against three published DeepSeek-V3 runs and this
project's single-GPU steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.pipeline_schedules import schedule
from dsl_lit.flops import attention_params, ffn_params_per_token
from dsl_lit.scaling.planner.attention_costs import attention_costs
from dsl_lit.scaling.planner.cluster import ClusterConfig
from dsl_lit.scaling.planner.layout import V3_RECIPE, PlanLayout
from dsl_lit.scaling.planner.memory import (
    FP8_TILE,
    FP32,
    block_activations,
    compute_bytes,
    optimizer_shard,
    rank_params,
    routed_shape,
    stage_layers_of,
    stages_on_rank,
)

ATTENTION_BACKWARD = 2.5
"""Flash attention's backward FLOPs over its forward's (5 matmuls against 2)."""


@dataclass
class StepTime:
    """Seconds per optimizer step, by what the busiest rank spends them on (exposed parts only)."""

    compute: float
    tp_comm: float
    ep_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    forward_per_micro_batch: float
    backward_per_micro_batch: float
    ep_comm_per_micro_batch: float
    """All-to-all time of one micro-batch on the rank, before any overlap."""

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.ep_comm + self.pp_comm + self.bubble + self.dp_comm + self.optimizer

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def _gemm_dtype(layout: PlanLayout) -> str:
    return {"fp8": "bf16", "fp16": "fp16"}.get(layout.precision, layout.precision)


def _block_matmul_params(cfg: ModelConfig, layer_id: int) -> float:
    """Activated matmul weights of one block outside the routed experts (attention, dense FFN or
    router and shared experts)."""
    return float(attention_params(cfg) + ffn_params_per_token(cfg, layer_id)) - _routed_matmul_params(cfg, layer_id)


def _routed_matmul_params(cfg: ModelConfig, layer_id: int) -> float:
    """Routed-expert weights one token goes through in one block (k experts' SwiGLU), the grouped GEMMs."""
    if not cfg.is_moe_layer(layer_id):
        return 0.0
    return 3.0 * cfg.d_model * cfg.moe_ffn_hidden * cfg.n_activated_experts


def _fp8_cast_bytes(cfg: ModelConfig, layer_id: int, layout: PlanLayout) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token of the FP8 casts around one block's linears.

    Elements per token: ``quantised`` distinct linear inputs cast in forward (a routed token is
    cast once, before its FP8 dispatch), ``retiled`` GEMM inputs re-tiled for the weight gradient
    (each routed copy), ``grads`` linear outputs whose gradient is cast."""
    if layout.precision != "fp8":
        return 0.0, 0.0
    tp, d = layout.parallel.tp, cfg.d_model
    h = cfg.n_heads / tp
    inputs, grads = attention_costs(cfg).fp8_cast_elements(cfg, h, d, tp)
    retiled = inputs
    if not cfg.is_moe_layer(layer_id):
        f = cfg.ffn_hidden / tp
        inputs, retiled, grads = inputs + d + f, retiled + d + f, grads + 2 * f + d
    else:
        k, f_routed = routed_shape(cfg, layout)
        f_shared = cfg.n_shared_experts * cfg.moe_ffn_hidden / tp
        inputs += d + f_shared + k * f_routed
        retiled += d + f_shared + k * (d + f_routed)
        grads += 2 * f_shared + d + k * (2 * f_routed + d)
    bf16 = 2.0
    return inputs * (bf16 + FP8_TILE), retiled * 2 * FP8_TILE + grads * (bf16 + 2 * FP8_TILE)


def _up_projection_params(cfg: ModelConfig) -> float:
    """The up-projection weights (MLA's query and key/value) that ``deepseek_v3`` recomputes."""
    return attention_costs(cfg).up_projection_params(cfg)


def _block_attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of scores and values, without causal halving (as ``dsl_lit.flops``)."""
    return cfg.attention.score_flops(cfg, seq_len)


def _bandwidth(cluster: ClusterConfig, group: int, span: int) -> float:
    """Bytes/s per GPU for a collective over ``group`` ranks spaced ``span`` GPUs apart."""
    eff = cluster.efficiency
    if group * span <= cluster.gpus_per_node:
        return cluster.nvlink_gbps * 1e9 * eff.nvlink
    return cluster.ib_gbps * 1e9 * eff.ib


def _all_to_all_seconds(cfg: ModelConfig, layout: PlanLayout, cluster: ClusterConfig, tokens: int) -> float:
    """One MoE layer's four all-to-alls (dispatch, combine; forward and backward) for ``tokens``."""
    if layout.parallel.ep == 1 or not cfg.is_moe:
        return 0.0
    eff, d, k = cluster.efficiency, cfg.d_model, cfg.n_activated_experts
    dispatch = 1 + 4 / 128 if layout.precision == "fp8" else 2  # FP8 values + one fp32 scale per 128
    per_copy = (dispatch + 2) * d * 2  # dispatch + combine, forward and backward
    span = layout.parallel.tp * layout.parallel.ep  # ep ranks are dp ranks, tp apart
    nodes = max(1, span // cluster.gpus_per_node)
    nvlink = cluster.nvlink_gbps * 1e9 * eff.nvlink
    if nodes == 1:
        return tokens * k * (layout.parallel.ep - 1) / layout.parallel.ep * per_copy / nvlink
    limited = cfg.n_expert_groups == nodes and cfg.n_limited_groups < cfg.n_expert_groups
    per_token_nodes = cfg.n_limited_groups if limited else min(k, nodes)
    if layout.routed_nodes is not None:
        per_token_nodes = min(layout.routed_nodes, nodes)
    ib_copies = per_token_nodes * (nodes - 1) / nodes
    ib = cluster.ib_gbps * 1e9 * eff.ib
    return max(tokens * ib_copies * per_copy / ib, tokens * k * per_copy / nvlink)


def estimate_step_time(cfg: ModelConfig, layout: PlanLayout, cluster: ClusterConfig) -> StepTime:
    eff = cluster.efficiency
    tokens = layout.micro_batch_size * layout.seq_len
    tp, size = layout.parallel.tp, compute_bytes(layout)
    gemm_peak = cluster.peak_flops(_gemm_dtype(layout)) * eff.gemm
    block_peak = cluster.peak_flops("fp8") * eff.fp8_gemm if layout.precision == "fp8" else gemm_peak
    attention_peak = cluster.peak_flops(_gemm_dtype(layout)) * eff.attention
    hbm = cluster.hbm_tbps * 1e12 * eff.hbm
    row = schedule(layout.parallel.pp_schedule)
    dualpipe = row.overlaps_all_to_all and layout.parallel.pp > 1  # its stage sends hide under compute too
    overlapped = layout.overlaps_all_to_all
    slowdown = cluster.sms / (cluster.sms - cluster.comm_sms) if overlapped else 1.0
    tp_bw = _bandwidth(cluster, tp, 1)
    tp_seconds_per_block = 4 * 2 * (tp - 1) / tp * tokens * cfg.d_model * size / tp_bw * (1 - eff.tp_overlap)

    stage_layers = stage_layers_of(cfg, layout)
    last = len(stage_layers) - 1
    ranks = []
    for rank in range(layout.parallel.pp):
        stages = stages_on_rank(rank, layout)
        blocks = [i for s in stages for i in stage_layers[s]]
        if last in stages:
            blocks += [cfg.n_layers + k for k in range(cfg.mtp_modules)]
        fwd_gemm = sum(2 * tokens * (_block_matmul_params(cfg, i) + _routed_matmul_params(cfg, i) / eff.grouped_gemm)
                       for i in blocks) / tp / block_peak
        head_gemm = 0.0
        if last in stages:
            head_gemm = 2 * tokens * cfg.d_model * cfg.vocab_size * (1 + cfg.mtp_modules) / tp / gemm_peak
        fwd_attention = len(blocks) * tokens * _block_attention_flops(cfg, layout.seq_len) / 2 / tp / attention_peak
        memory_bound = sum(tokens * block_activations(cfg, i, "none", layout) for i in blocks) * eff.activation_passes / hbm
        casts = [_fp8_cast_bytes(cfg, i, layout) for i in blocks]
        cast_fwd, cast_bwd = (tokens * sum(c[j] for c in casts) / hbm for j in (0, 1))
        tp_comm = len(blocks) * tp_seconds_per_block
        forward = (fwd_gemm + head_gemm + fwd_attention) * slowdown + memory_bound / 4 + cast_fwd
        weight_grad = (fwd_gemm + head_gemm) * slowdown
        backward = 2 * weight_grad + ATTENTION_BACKWARD * fwd_attention * slowdown + 3 * memory_bound / 4 + cast_bwd
        if layout.recompute == "full":
            backward += (fwd_gemm + fwd_attention) * slowdown + memory_bound / 4 + cast_fwd
        elif layout.recompute != "none":  # norms and activations again; deepseek_v3: MLA up-projections too
            backward += memory_bound / 4
            if layout.recompute == V3_RECIPE:
                backward += len(blocks) * 2 * tokens * _up_projection_params(cfg) / tp / block_peak * slowdown
        moe_layers = sum(1 for i in blocks if cfg.is_moe_layer(i))
        ep_comm = moe_layers * _all_to_all_seconds(cfg, layout, cluster, tokens // tp)
        ranks.append((forward, backward, weight_grad, tp_comm, ep_comm, rank))
    forward, backward, weight_grad, tp_comm, ep_comm, busiest = max(ranks, key=lambda r: r[0] + r[1] + r[3] + r[4])

    m = layout.micro_batches
    chunks = layout.chunks_per_rank
    passes = m / row.copies_per_stage  # each of DualPipe's two directions sees half of the micro-batches
    if overlapped:  # a chunk's all-to-all runs under the paired chunk's compute
        ep_exposed = max(0.0, ep_comm - (forward + backward))
    else:
        ep_exposed = ep_comm
    pp_boundary = 0.0
    if layout.parallel.pp > 1:
        pp_bw = _bandwidth(cluster, layout.parallel.pp, layout.parallel.tp * layout.parallel.dp)
        # each tp rank sends its 1/tp of the hidden states (sequence parallelism, or Megatron's
        # scatter-gather of pipeline sends without it); hidden by a schedule that overlaps communication
        hidden = dualpipe or overlapped
        pp_boundary = 0.0 if hidden else 2 * chunks * tokens / tp * cfg.d_model * size / pp_bw
    f, b, w = ((forward + tp_comm / 2) / chunks, (backward + tp_comm / 2) / chunks, weight_grad / chunks)
    bubble = _bubble(layout, f, b, w)

    # data parallelism: gradients of this rank's parameters
    params = rank_params(cfg, layout, busiest)
    dense_params, expert_params = params.dense, params.experts
    dp_comm = 0.0
    for count, group in ((dense_params, layout.parallel.dp), (expert_params, max(1, layout.parallel.dp // layout.parallel.ep))):
        if group == 1 or count == 0:
            continue
        bw = _bandwidth(cluster, group, layout.parallel.tp)
        fraction = (group - 1) / group
        if layout.parallel.zero1:
            reduce_scatter = fraction * count * FP32 / bw
            all_gather = fraction * count * (FP32 if layout.precision == "fp32" else 2) / bw
            dp_comm += max(0.0, reduce_scatter - backward / chunks) + all_gather
        else:
            dp_comm += max(0.0, 2 * fraction * count * FP32 / bw - backward / chunks)
    # AdamW over the shard: read the gradient, read and write master weights and both moments (fp32),
    # write the weights; then every gradient is zeroed
    shard_bytes = FP32 + 2 * FP32 + 2 * 2 * FP32 + compute_bytes(layout)
    optimizer = (optimizer_shard(params, layout) * shard_bytes + (dense_params + expert_params) * FP32) / hbm

    return StepTime(
        compute=passes * (forward + backward), tp_comm=passes * tp_comm, ep_comm=passes * ep_exposed,
        pp_comm=passes * pp_boundary, bubble=bubble, dp_comm=dp_comm, optimizer=optimizer,
        forward_per_micro_batch=forward, backward_per_micro_batch=backward, ep_comm_per_micro_batch=ep_comm,
    )


def _bubble(layout: PlanLayout, f: float, b: float, w: float) -> float:
    """Idle time of a rank per step, per schedule (f, b, w: one chunk's times)."""
    pp = layout.parallel.pp
    if pp == 1:
        return 0.0
    return BUBBLE[layout.parallel.pp_schedule](pp, f, b, w)


def _dualpipe_bubble(stages_per_direction: int) -> Callable[[int, float, float, float], float]:
    """DeepSeek-V3's Table 2 for DualPipe over PP stages: (PP/2 - 1)(F&B + B - 3W); DualPipeV's V
    over pp ranks has 2 pp stages."""
    return lambda pp, f, b, w: max(0.0, stages_per_direction * pp / 2 - 1) * (f + b + b - 3 * w)


BUBBLE: dict[str, Callable[[int, float, float, float], float]] = {
    "GPipe": lambda pp, f, b, w: (pp - 1) * (f + b),
    "1F1B": lambda pp, f, b, w: (pp - 1) * (f + b),
    "Interleaved1F1B": lambda pp, f, b, w: (pp - 1) * (f + b),  # per chunk: Interleaved's (pp-1)(F+B)/v
    "ZB1P": lambda pp, f, b, w: (pp - 1) * (f + b - 2 * w),
    "DualPipe": _dualpipe_bubble(1),
    "DualPipeV": _dualpipe_bubble(2),
}
"""(pp, one chunk's forward, backward and weight-gradient seconds) -> a rank's idle seconds per
step, per row of :data:`~dsl_lit.config.pipeline_schedules.SCHEDULE_TABLE` (a test ties the two)."""
