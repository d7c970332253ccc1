"""Tensor-parallel plans as data: module FQN -> the name of a parallel style.

Models never import ``torch.distributed``'s parallel styles: a family declares *what* each module
does under tensor parallelism with the names below, and ``dsl_lit.parallel.tensor_parallel`` turns
each name into one ``ParallelStyle`` (or, for :data:`SHARED_ROPE_KEY`, a gradient hook). Every
decision that depends on sequence parallelism is taken here, so a name means one thing.

Megatron-style: a column-parallel projection splits its output features (heads, FFN hidden) so
each rank computes its own heads; the row-parallel projection after it splits its input features
and reduces the output. The model code is unchanged because it reshapes with ``-1`` heads.
:func:`decoder_plan` is the plan of the shared decoder (embedding, blocks, MTP modules, head); a
family supplies the plan of its attention (see ``deepseek_llm/parallelize.py``,
``deepseek_v3/parallelize.py``).

Sequence parallelism (Megatron-SP): between blocks the residual stream is a DTensor sharded on the
sequence, so norms, residual adds and their activations cost 1/tp. The embedding reduce-scatters
onto sequence shards; a block's norms run on the shard, its attention and FFN inputs are
all-gathered, and the row-parallel outputs reduce-scatter back (the all-reduce of plain TP split
in two, same volume). An MoE layer gathers the sequence at its input and takes its (replicated)
output back to the shard: router and routed experts see every token on every tp rank (experts
shard with expert parallelism instead), the shared experts are column / row parallel inside. The
final norm works on the shard and the head gathers the sequence (still vocab-sharded). MTP modules
run without SP: their sequences are 1..D tokens shorter (not divisible by tp) and they are one
block each; their inputs are gathered to full tensors and their norm hands the shared head a
replicated DTensor.
"""

from __future__ import annotations

from collections.abc import Callable

from dsl_lit.config.model import ModelConfig

# -- projections -----------------------------------------------------------------------------------
COLWISE = "colwise"
"""Split the output features (heads, FFN hidden); the input is replicated."""
ROWWISE = "rowwise"
"""Split the input features; the output is all-reduced to a plain tensor."""
ROWWISE_TO_SEQUENCE = "rowwise_to_sequence"
"""Split the input features; the output is reduce-scattered onto the residual stream's sequence
shards (a DTensor)."""
KV_HEAD_PER_RANK = "kv_head_per_rank"
"""Grouped-query wk / wv when tp is a multiple of ``kv_heads``: the weight stays whole (replicated)
and each rank computes the one kv head its query heads use."""
SHARED_ROPE_KEY = "shared_rope_key"
"""A replicated projection whose last ``rope_dim`` outputs are a rotary key shared by every rank's
own heads: that part of its output gradient is summed over tp (Megatron's "f")."""
SHARED_BY_HEADS = "shared_by_heads"
"""A replicated module whose whole output every rank's own heads read (DeepSeek-V4's one key/value
head after its norm, a compressor's pooled keys): its output gradient is summed over tp, so the
module and everything before it see the gradient of all heads."""
HEAD_SHARDED = "head_sharded"
"""A parameter (not a module) with one entry per attention head along its first dimension
(DeepSeek-V4's attention sinks): split over tp like the heads."""
# -- vocabulary --------------------------------------------------------------------------------------
VOCAB_EMBEDDING = "vocab_embedding"
"""Row-parallel over the vocabulary (each rank looks up its slice, the rows are summed)."""
VOCAB_EMBEDDING_TO_SEQUENCE = "vocab_embedding_to_sequence"
"""As :data:`VOCAB_EMBEDDING`, reduce-scattered onto sequence shards."""
VOCAB_HEAD = "vocab_head"
"""Column-parallel over the vocabulary; the logits stay vocab-sharded for the vocab-parallel loss."""
VOCAB_HEAD_FROM_SEQUENCE = "vocab_head_from_sequence"
"""As :data:`VOCAB_HEAD`, on sequence-sharded input (gathered first)."""
# -- sequence-parallel glue ------------------------------------------------------------------------
SEQUENCE_PARALLEL = "sequence_parallel"
"""A norm computed on the sequence shard."""
GATHER_ATTENTION_INPUT = "gather_attention_input"
"""An attention's input (its first of the block's four arguments) gathered to a replicated DTensor,
so that the projections' input gradients add up before one reduce-scatter."""
GATHER_ATTENTION_INPUT_LOCAL = "gather_attention_input_local"
"""As :data:`GATHER_ATTENTION_INPUT`, handed on as the plain full tensor (for attentions with
replicated plain projections)."""
GATHER_FFN_INPUT = "gather_ffn_input"
"""A dense FFN's input gathered to a replicated DTensor."""
GATHER_MOE_INPUT = "gather_moe_input"
"""An MoE layer's input gathered to the plain full tensor; its complete output goes back to
sequence shards without communication."""
FULL_SEQUENCE_INPUTS = "full_sequence_inputs"
"""Every DTensor argument made the full, replicated plain tensor (an MTP module's inputs)."""
REPLICATED_OUTPUT = "replicated_output"
"""The output handed on as a replicated DTensor (an MTP module's norm, read by the shared head)."""

STYLES = frozenset({
    COLWISE, ROWWISE, ROWWISE_TO_SEQUENCE, KV_HEAD_PER_RANK, SHARED_ROPE_KEY, SHARED_BY_HEADS, HEAD_SHARDED, VOCAB_EMBEDDING,
    VOCAB_EMBEDDING_TO_SEQUENCE, VOCAB_HEAD, VOCAB_HEAD_FROM_SEQUENCE, SEQUENCE_PARALLEL,
    GATHER_ATTENTION_INPUT, GATHER_ATTENTION_INPUT_LOCAL, GATHER_FFN_INPUT, GATHER_MOE_INPUT,
    FULL_SEQUENCE_INPUTS, REPLICATED_OUTPUT,
})

Plan = dict[str, str]
AttentionPlan = Callable[[ModelConfig, int, bool], Plan]
"""``(cfg, tp, sequence_parallel) -> {name inside the attention module: style}``."""


def swiglu_plan(prefix: str, to_sequence: bool) -> Plan:
    """w1 / w3 column-parallel, w2 row-parallel (onto sequence shards when ``to_sequence``)."""
    return {f"{prefix}.w1": COLWISE, f"{prefix}.w3": COLWISE, f"{prefix}.w2": ROWWISE_TO_SEQUENCE if to_sequence else ROWWISE}


def block_plan(
    cfg: ModelConfig, layer_id: int, prefix: str, tp: int, sequence_parallel: bool,
    attention: AttentionPlan, attention_input: str,
) -> Plan:
    """One block: its attention's own plan, the FFN (dense SwiGLU, or MoE whose router and routed
    experts stay replicated and whose shared experts split as a SwiGLU) and, under sequence
    parallelism, the norms and the gathering of the sub-blocks' inputs (``attention_input``: how
    the family's attention wants it)."""
    sp = sequence_parallel
    plan: Plan = {}
    if sp:
        plan[f"{prefix}.attention_norm"] = SEQUENCE_PARALLEL
        plan[f"{prefix}.ffn_norm"] = SEQUENCE_PARALLEL
        plan[f"{prefix}.attention"] = attention_input
    plan.update({f"{prefix}.attention.{name}": style for name, style in attention(cfg, tp, sp).items()})
    ffn = f"{prefix}.feed_forward"
    if not cfg.is_moe_layer(layer_id):
        if sp:
            plan[ffn] = GATHER_FFN_INPUT
        plan.update(swiglu_plan(ffn, to_sequence=sp))
        return plan
    if sp:
        plan[ffn] = GATHER_MOE_INPUT
    if cfg.n_shared_experts:
        plan.update(swiglu_plan(f"{ffn}.shared_experts", to_sequence=False))
    return plan


def decoder_plan(
    cfg: ModelConfig, tp: int, sequence_parallel: bool, attention: AttentionPlan, attention_input: str
) -> Plan:
    """The whole model (names as in ``Transformer``) over ``tp`` ranks."""
    sp = sequence_parallel
    plan: Plan = {"tok_embeddings": VOCAB_EMBEDDING_TO_SEQUENCE if sp else VOCAB_EMBEDDING}
    for i in range(cfg.n_layers):
        plan.update(block_plan(cfg, i, f"layers.{i}", tp, sp, attention, attention_input))
    for k in range(cfg.mtp_modules):
        plan.update(block_plan(cfg, cfg.n_layers + k, f"mtp.{k}.block", tp, False, attention, attention_input))
        if sp:
            plan[f"mtp.{k}"] = FULL_SEQUENCE_INPUTS
            # the head expects sequence shards unless it is handed a DTensor that says otherwise
            plan[f"mtp.{k}.norm"] = REPLICATED_OUTPUT
    if sp:
        plan["norm"] = SEQUENCE_PARALLEL
    plan["output"] = VOCAB_HEAD_FROM_SEQUENCE if sp else VOCAB_HEAD
    return plan
