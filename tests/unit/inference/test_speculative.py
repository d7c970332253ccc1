"""MTP speculative decoding: the same tokens as plain greedy decoding, fewer main-model forwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsl_lit.inference.generation import generate
from dsl_lit.models import ModelConfig, build_model

CFG = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, ffn_hidden=128, n_routed_experts=4, n_activated_experts=2,
           moe_ffn_hidden=32, n_expert_groups=2, n_limited_groups=1, vocab_size=64, max_seq_len=128)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig.from_name("deepseek_v3_tiny", **CFG)).float()


def _trained_on_a_cycle(steps: int = 60) -> torch.nn.Module:
    """Main head and MTP head both learn the cycle t -> (3 t + 1) mod 61 (so drafts get accepted)."""
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        start = torch.randint(0, 61, (8, 1), generator=torch.Generator().manual_seed(step))
        seq = [start]
        for _ in range(32):
            seq.append((3 * seq[-1] + 1) % 61)
        tokens = torch.cat(seq, dim=1)
        hidden = model.hidden_states(tokens[:, :-1])
        loss = F.cross_entropy(model.head(hidden).flatten(0, 1), tokens[:, 1:].flatten())
        (mtp_logits,) = model.mtp_logits(hidden, tokens[:, :-1])
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


def test_speculative_needs_an_mtp_module_and_greedy():
    import pytest

    dense = build_model(ModelConfig.from_name("deepseek_llm_tiny", n_layers=1, vocab_size=64))
    with pytest.raises(ValueError, match="MTP module"):
        generate(dense, [[1, 2]], 4, mtp_speculative=True)
    with pytest.raises(ValueError, match="temperature=0"):
        generate(_model(0), [[1, 2]], 4, mtp_speculative=True, temperature=1.0)
    v4 = build_model(ModelConfig.from_name("deepseek_v4_tiny", n_layers=1, vocab_size=64, mtp_depth=1))
    with pytest.raises(ValueError, match="deepseek_v4's does not draft yet"):  # its MTP module trains; V3's drafts
        generate(v4, [[1, 2]], 4, mtp_speculative=True)
