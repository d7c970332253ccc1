"""Context parallelism's building block: a whole model of either family on cp=2 gloo ranks, each
holding its load-balanced half of the sequence, gives one process's logits and (summed over the
ranks) gradients. The strategy wiring (``parallel.cp``) is not built yet."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.attention import attention_mask
from dsl_lit.ops import cross_entropy
from dsl_lit.parallel.context_parallel import ContextParallelKeys, gather_order, rank_positions
from tests.numerics import assert_close_fp32

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
    torch.manual_seed(0)
    cfg = ModelConfig.from_name(name, n_layers=2, mtp_depth=0, max_seq_len=SEQ)
    if cfg.n_routed_experts:
        cfg = ModelConfig.from_name(name, n_layers=2, mtp_depth=0, max_seq_len=SEQ, seq_balance_alpha=0.0)
    return build_model(cfg).float()


def _data(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _rank(rank: int, init_file: str, name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        reference, model = _model(name), _model(name)
        inputs, labels = _data(model.config.vocab_size)
        logits = reference(inputs)
        cross_entropy(logits.clone(), labels, reduction="sum").div(labels.numel()).backward()

        keys = ContextParallelKeys(SEQ, dist.group.WORLD)
        positions = keys.query_positions.expand(BATCH, -1)
        local = model(keys.shard(inputs), positions=positions, cache=keys)
        cross_entropy(local.clone(), keys.shard(labels), reduction="sum").div(labels.numel()).backward()
        assert_close_fp32(local, logits[:, keys.query_positions], model.config.d_model * SEQ, msg="logits")
        for (param_name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if p.grad is None:
                assert q.grad is None or not q.grad.any(), param_name
                continue
            dist.all_reduce(p.grad)  # cp ranks hold replicas: their gradients add up, as over dp
            assert_close_fp32(p.grad, q.grad, BATCH * SEQ * model.config.d_model, msg=param_name)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_llm_tiny", "deepseek_v3_tiny"])
def test_cp2_matches_one_process(tmp_path, name):
    mp.spawn(_rank, args=(str(tmp_path / "init"), name), nprocs=2, join=True)
