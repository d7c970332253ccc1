"""Context parallelism's building blocks: a whole model of either family on cp=2 gloo ranks, each
holding its load-balanced half of the sequence, gives one process's logits, MTP logits, balance loss
and (summed over the ranks) gradients. The recipe under ``parallel.cp`` is checked against one
process in tests/e2e/parallel/test_parallel_e2e.py; its configuration errors here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.attention import attention_mask
from dsl_lit.models.common.moe import TopKRouter
from dsl_lit.ops import cross_entropy
from dsl_lit.parallel.context_parallel import (
    ContextParallelKeys,
    apply_context_parallel,
    gather_order,
    rank_positions,
)
from tests.numerics import EPS32, assert_close_fp32, fp32_tolerance
from tests.ranks import spawn

SEQ, BATCH = 32, 2


def test_each_rank_holds_two_chunks_with_the_same_attention_work():
    for cp in (2, 4):
        held = [rank_positions(64, cp, r) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(64))
        work = {int((p + 1).sum()) for p in held}  # keys each rank's queries see under the causal mask
        assert len(work) == 1, work
        assert torch.equal(torch.cat(held)[gather_order(64, cp)], torch.arange(64))
    assert rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 2 x cp = 4"):
        rank_positions(10, 2, 0)


@pytest.mark.parametrize("padded", [False, True])
def test_the_mask_of_a_ranks_queries_is_those_rows_of_the_full_mask(padded):
    key_valid = (torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(0)) > 0.3) if padded else None
    full = attention_mask(SEQ, SEQ, key_valid, torch.device("cpu"))
    for rank in range(2):
        positions = rank_positions(SEQ, 2, rank)
        ours = attention_mask(len(positions), SEQ, key_valid, torch.device("cpu"), positions)
        assert torch.equal(ours, full[:, :, positions])


def _model(name: str) -> torch.nn.Module:
    """Two layers; V3 with two MTP depths and both balance losses at a weight that shows in gradients.
    V4: its 4 layers (hca, sliding, csa, hca; the first hash-routed), one MTP module; a 16-token window
    and 16-token HCA windows reach across the ranks' 8-token chunks, CSA's indexer keeps 4 of up to 8."""
    torch.manual_seed(0)
    extra = {"mtp_depth": 2, "seq_balance_alpha": 0.1, "batch_balance_alpha": 0.1} if "v3" in name else {}
    if "v32" in name:  # sparse training: top 8 of up to 32 keys, the indexers' KL in the objective
        extra |= {"index_topk": 8, "index_training": "sparse"}
    if "v4" in name:
        extra = {"mtp_depth": 1, "seq_balance_alpha": 0.1, "batch_balance_alpha": 0.1}
    layers = {} if "v4" in name else {"n_layers": 2}
    return build_model(ModelConfig.from_name(name, max_seq_len=SEQ, **layers, **extra)).float()


def _data(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # ignored targets, unevenly spread over the ranks' chunks
    return tokens[:, :-1], labels


def _objective(model, logits, mtp_logits, labels_of, counts, balance_weight) -> torch.Tensor:
    """Main + mean over depths of MTP cross-entropy (each over its global target count) + balance."""
    loss = cross_entropy(logits, labels_of(0), reduction="sum") / counts[0]
    for k, depth_logits in enumerate(mtp_logits, start=1):
        loss = loss + cross_entropy(depth_logits, labels_of(k), reduction="sum") / counts[k] / len(mtp_logits)
    balance = model.balance_loss()
    loss = loss if balance is None else loss + balance_weight * balance
    index = model.index_losses()  # DeepSeek-V3.2's indexers: whole rows' KL on every rank, like balance
    return loss if index is None else loss + balance_weight * index[0]


def _rank(rank: int, init_file: str, name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        reference, model = _model(name), _model(name)
        inputs, labels = _data(model.config.vocab_size)
        depths = range(len(model.mtp) + 1)
        counts = [(labels[:, k:] != -100).sum() for k in depths]  # what the step normalises by
        residual = reference.residual(inputs)  # what MTP reads: V4's hc_mult streams, the hidden state elsewhere
        mtp = reference.mtp_logits(residual, inputs)
        logits = reference.head(reference.collapse(residual))
        _objective(reference, logits, mtp, lambda k: labels[:, k:], counts, 1.0).backward()

        keys = ContextParallelKeys(SEQ, dist.group.WORLD)
        apply_context_parallel(model, dist.group.WORLD)
        positions = keys.query_positions.expand(BATCH, -1)
        local_residual = model.residual(keys.shard(inputs), positions, cache=keys)
        local_mtp = model.mtp_logits(local_residual, inputs, keys)
        local = model.head(model.collapse(local_residual))
        # each rank computes the whole rows' balance loss: its gradient, summed over 2 ranks, counts twice
        _objective(model, local, local_mtp, lambda k: keys.shift(labels, k, -100) if k else keys.shard(labels),
                   counts, 0.5).backward()
        assert_close_fp32(local, logits[:, keys.query_positions], model.config.d_model * SEQ, msg="logits")
        for k, (ours, theirs) in enumerate(zip(local_mtp, mtp, strict=True), start=1):
            kept = keys.query_positions < SEQ - k  # the last k positions predict nothing
            assert_close_fp32(ours[:, kept], theirs[:, keys.query_positions[kept]], model.config.d_model * SEQ,
                              msg=f"MTP depth {k}")
        if reference.balance_loss() is not None:
            assert_close_fp32(model.balance_loss(), reference.balance_loss(), 1.0, msg="balance loss")
        if reference.index_losses() is not None:  # over whole rows' queries, an MTP block's last k left out
            (kl, recall), (kl_ref, recall_ref) = model.index_losses(), reference.index_losses()
            # recall: a mean of softmax masses in [0, 1] (an MTP block's softmaxes run over seq, not
            # seq - k, keys here): fp32 rounding of sums of SEQ terms; an extra query (the MTP block's
            # last, past the row's end) moved it by 1e-2. KL: each query's is ~1e-6 made of 8 terms of
            # ~0.4 that nearly cancel, so its rounding is a few percent of it
            torch.testing.assert_close(recall, recall_ref, rtol=0, atol=SEQ * EPS32)
            torch.testing.assert_close(kl, kl_ref, rtol=5e-2, atol=0)
        routers = [(m, r) for m, r in zip(model.modules(), reference.modules(), strict=True) if isinstance(m, TopKRouter)]
        for ours, theirs in routers:  # expert loads (the bias update's input) over the ranks' tokens
            dist.all_reduce(ours.load.counts)
            assert torch.equal(ours.load.counts, theirs.load.counts)
        # V3: one MoE layer, two MTP depths; V4: three top-k layers (the first is hash-routed), one MTP module
        assert len(routers) == {"deepseek_v3_tiny": 3, "deepseek_v32_tiny": 3, "deepseek_v4_tiny": 4}.get(name, 0)
        for (param_name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if p.grad is None:
                assert q.grad is None or not q.grad.any(), param_name
                continue
            dist.all_reduce(p.grad)  # cp ranks hold replicas: their gradients add up, as over dp
            reference_grad = q.grad
            if ".hc_head." in f".{param_name}":
                # V4's stream collapse feeds an RMSNorm, blind to a scale shared by the 4 near-equal
                # streams: its gradient is a near-cancelling sum (~1e-6 against ~1e-3 of the norm's),
                # so it carries the rounding of the gradient reaching the norm that reads it
                norm = dict(reference.named_parameters())[param_name.split("hc_head.")[0] + "norm.weight"]
                reference_grad = torch.full_like(q.grad, norm.grad.abs().max().item())
            tolerance = fp32_tolerance(reference_grad, BATCH * SEQ * model.config.d_model)
            torch.testing.assert_close(p.grad, q.grad, **tolerance, msg=lambda m, n=param_name: f"{n}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_llm_tiny", "deepseek_v3_tiny", "deepseek_v32_tiny", "deepseek_v4_tiny"])
def test_cp2_matches_one_process(tmp_path, name):
    spawn(_rank, args=(str(tmp_path / "init"), name), nprocs=2)
