"""MTP speculative decoding: the same tokens as plain greedy decoding, fewer main-model forwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsl_lit.inference.generation import generate
from dsl_lit.models import ModelConfig, build_model

CFG = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, ffn_hidden=128, n_routed_experts=4, n_activated_experts=2,
           moe_ffn_hidden=32, n_expert_groups=2, n_limited_groups=1, vocab_size=64, max_seq_len=128)
# DeepSeek-V4: a hash-routed HCA layer (a key per 8 tokens), a CSA layer (a key per 4, its indexer's
# top 2) and a sliding one, all with a window of 8; its MTP block is a sliding V4 block on the 4
# streams. 8 indexer heads: with 2, the indexer's ReLU scores tie at exactly 0 often, and topk breaks
# ties by the tensor's length, so a 2-token forward may choose other windows than a 1-token one
V4 = dict(n_layers=3, d_model=64, n_heads=4, attention_head_dim=32, q_lora_rank=32, qk_rope_head_dim=8,
          n_activated_experts=2, moe_ffn_hidden=32, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
          index_topk=2, attention_kinds=["hca", "csa", "sliding"], csa_rate=4, hca_rate=8, sliding_window=8,
          vocab_size=64, max_seq_len=128, mtp_depth=1)


def _model(seed: int, family: str = "deepseek_v3") -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig.from_name(f"{family}_tiny", **(V4 if family == "deepseek_v4" else CFG))).float()


def _trained_on_a_cycle(family: str = "deepseek_v3", steps: int = 60) -> torch.nn.Module:
    """Main head and MTP head both learn the cycle t -> (3 t + 1) mod 61 (so drafts get accepted)."""
    model = _model(0, family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        start = torch.randint(0, 61, (8, 1), generator=torch.Generator().manual_seed(step))
        seq = [start]
        for _ in range(32):
            seq.append((3 * seq[-1] + 1) % 61)
        tokens = torch.cat(seq, dim=1)
        residual = model.residual(tokens[:, :-1])  # what MTP reads (V4: the streams before their collapse)
        loss = F.cross_entropy(model.head(model.collapse(residual)).flatten(0, 1), tokens[:, 1:].flatten())
        (mtp_logits,) = model.mtp_logits(residual, tokens[:, :-1])
        loss = loss + F.cross_entropy(mtp_logits.flatten(0, 1), tokens[:, 2:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def _check(model: torch.nn.Module, prompts: list[list[int]], new: int = 24) -> float:
    plain = generate(model, prompts, new, pad_token_id=0)
    fast = generate(model, prompts, new, pad_token_id=0, mtp_speculative=True)
    assert torch.equal(fast.sequences, plain.sequences)
    assert torch.equal(fast.completion_mask, plain.completion_mask)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, rtol=0, atol=1e-4)  # 1- vs 2-token forwards
    stats = fast.draft_stats
    assert stats.forwards == new - 1 - stats.accepted  # every accepted draft saves one forward
    return stats.acceptance


def test_speculative_equals_greedy_on_a_random_model():
    model = _model(1)
    _check(model, [[5, 9, 2]])
    _check(model, [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6]])  # left-padded batch


def test_speculative_equals_greedy_on_a_trained_model_and_accepts_most_drafts():
    model = _trained_on_a_cycle()
    acceptance = _check(model, [[4, 13, 40]])
    assert acceptance > 0.8, acceptance


def test_deepseek_v4s_mtp_block_drafts_the_tokens_of_greedy_decoding():
    """V4's MTP block drafts with its own KV cache (its sliding window over the cached keys, on the
    main model's streams): prompts and continuations past the window and several compressed windows
    give plain greedy decoding's tokens; on the cycle, most drafts are accepted (measured: 11 of 12; V3's: 11 of 12)."""
    model = _model(1, "deepseek_v4")
    _check(model, [[5, 9, 2]])
    _check(model, [list(range(1, 14))])  # 13 tokens: past the window of 8, an HCA window and 3 CSA ones
    _check(model, [[5, 9, 2], [7], list(range(3, 23))])  # left-padded, the longest 20 tokens
    acceptance = _check(_trained_on_a_cycle("deepseek_v4", steps=20), [[4, 13, 40]])  # (learnt by step 20)
    assert acceptance > 0.8, acceptance


@torch.no_grad()
def test_deepseek_v4s_incremental_drafts_are_its_training_forwards_predictions():
    """The drafter run over a sequence in decoding's chunks (the prompt, then 1 or 2 positions, its
    cache carrying the window's keys across them) predicts at every position what the MTP block's
    whole-sequence forward (training's ``mtp_logits``) predicts there: weights drawn at scale, so
    that what the block attends to moves its argmax."""
    from dsl_lit.inference.speculative import _MTPDrafter
    from tests.unit.models.test_deepseek_v4_model import _randomised

    model = _randomised(_model(1, "deepseek_v4"), seed=2).eval()
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(3))
    residual = model.residual(tokens)
    expected = model.mtp_logits(residual, tokens)[0].argmax(-1)  # [2, 29]: at i, the token i + 2
    drafter = _MTPDrafter(model, 2, 30)
    positions, valid = torch.arange(30).expand(2, -1), torch.ones(2, 30, dtype=torch.bool)
    got, start = [], 0
    for size in [5, 1, 2, 2, 1, 1, 2, 1, 2, 2, 1, 1, 2, 2, 1, 2, 1]:  # 29 positions; windows of 8 in between
        end = start + size
        drafts = drafter.draft(residual[:, start:end], tokens[:, start + 1 : end + 1], positions[:, start:end],
                               valid[:, :end])
        got.append((end - 1, drafts))
        start = end
    assert start == 29
    assert torch.equal(torch.stack([d for _, d in got], 1), expected[:, [i for i, _ in got]])
    assert expected.unique().numel() > 20  # the predictions vary: a wrong window would move them


def test_speculative_needs_an_mtp_module_and_greedy():
    import pytest

    dense = build_model(ModelConfig.from_name("deepseek_llm_tiny", n_layers=1, vocab_size=64))
    with pytest.raises(ValueError, match="MTP module"):
        generate(dense, [[1, 2]], 4, mtp_speculative=True)
    with pytest.raises(ValueError, match="temperature=0"):
        generate(_model(0), [[1, 2]], 4, mtp_speculative=True, temperature=1.0)
