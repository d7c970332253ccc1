"""Generation with a KV cache: cached == full recompute, left padding, sampling, eos, MLA cache size."""

from __future__ import annotations

import functools

import pytest
import torch

import dsl_lit.inference.generation as generation
from dsl_lit.inference.generation import (
    filter_logits,
    generate,
    positions_from_mask,
    sample_next_token,
    top_k_mask,
    top_p_mask,
)
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.common.kv_cache import KVCache
from tests.numerics import assert_close_fp32

PRESETS = ["deepseek_llm_tiny", "deepseek_v3_tiny"]
VOCAB = 512
REDUCTION = 64 * 2 * 28  # width x layers x the longest sequence: the sums behind a logit, reordered by the cache
SHRINK = {
    "deepseek_llm_tiny": dict(n_heads=4, n_kv_heads=2, ffn_hidden=128),
    "deepseek_v3_tiny": dict(
        n_heads=4, n_kv_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, ffn_hidden=128, moe_ffn_hidden=32, n_routed_experts=8, n_activated_experts=2,
        n_expert_groups=4, n_limited_groups=2,
    ),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: one intra-op thread is as fast and avoids OpenMP spin-waits on a
    busy machine (5x slower there with two); restored for the rest of the session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _model(name: str):
    torch.manual_seed(0)
    # init_std 0.1 (not 0.006) so that logits are far from uniform and greedy output varies.
    cfg = ModelConfig.from_name(
        name, n_layers=2, vocab_size=VOCAB, d_model=64, max_seq_len=64, init_std=0.1, **SHRINK[name]
    )
    return build_model(cfg).eval()


def _prompts(lengths=(3, 7, 12), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def _greedy(name: str, use_cache: bool = True):
    """Greedy generation of the three default prompts (shared by several tests)."""
    return generate(_model(name), _prompts(), 16, use_cache=use_cache, output_logits=True)


@pytest.mark.parametrize("name", PRESETS)
def test_greedy_cached_equals_uncached(name):
    prompts = _prompts()
    cached, full = _greedy(name), _greedy(name, use_cache=False)
    assert cached.sequences.shape == (3, 12 + 16)
    assert torch.equal(cached.sequences, full.sequences)
    assert cached.completions == full.completions
    assert all(len(c) == 16 for c in cached.completions)
    # the prompts sit left-padded in front of the completions
    for row, prompt in zip(cached.sequences.tolist(), prompts):
        assert row[12 - len(prompt) : 12] == prompt and row[: 12 - len(prompt)] == [0] * (12 - len(prompt))
    assert max(len(set(c)) for c in cached.completions) > 3  # not a constant token


@pytest.mark.parametrize("name", PRESETS)
def test_cached_logits_match_full_recompute(name):
    model = _model(name)
    cached, full = _greedy(name), _greedy(name, use_cache=False)
    assert cached.logits.shape == (3, 16, VOCAB) and cached.logits.dtype == torch.float32
    assert_close_fp32(cached.logits, full.logits, REDUCTION, msg="cached vs recomputed")

    # Independently of the padding logic: one unpadded prompt against the plain training forward.
    single = generate(model, [_prompts()[2]], 10, output_logits=True)
    with torch.no_grad():
        reference = model(single.sequences)[:, 12 - 1 : -1]
    assert_close_fp32(single.logits, reference, REDUCTION, msg="generation vs training forward")


def test_positions_count_only_real_tokens():
    valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    assert positions_from_mask(valid).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("name", PRESETS)
def test_left_padding_does_not_change_a_prompt(name):
    # This catches a wrong key mask; a uniform position shift alone would not show (RoPE only sees
    # relative positions), hence the positions test above and the cached-step checks elsewhere.
    model = _model(name)
    short, long_a, long_b = _prompts((4, 11, 15))
    alone = generate(model, [short], 12, output_logits=True)
    batched = generate(model, [long_a, short, long_b], 12, output_logits=True)
    assert batched.prompt_length == 15
    assert alone.completions[0] == batched.completions[1]
    assert_close_fp32(batched.logits[1], alone.logits[0], REDUCTION, msg="logits")
    assert_close_fp32(batched.logprobs[1], alone.logprobs[0], REDUCTION, msg="logprobs")


@pytest.mark.parametrize("name", PRESETS)
def test_sampling_is_reproducible_and_cached_equals_uncached(name):
    model = _model(name)
    prompts = _prompts()
    kwargs = dict(temperature=0.9, top_p=0.9, top_k=64, output_logits=True)

    def run(seed: int, use_cache: bool = True):
        return generate(model, prompts, 16, generator=torch.Generator().manual_seed(seed), use_cache=use_cache, **kwargs)

    first, again, uncached, other = run(7), run(7), run(7, use_cache=False), run(8)
    assert torch.equal(first.sequences, again.sequences)
    assert torch.equal(first.sequences, uncached.sequences)
    assert not torch.equal(first.sequences, other.sequences)
    assert_close_fp32(first.logprobs, uncached.logprobs, REDUCTION)
    # logprobs are those of the raw model logits (no temperature, no filtering)
    expected = first.logits.log_softmax(-1).gather(-1, first.completion_ids[..., None]).squeeze(-1)
    assert_close_fp32(first.logprobs, expected, VOCAB)
    # sampling differs from greedy, and top_k=1 sampling is greedy
    greedy = _greedy(name)
    assert not torch.equal(first.sequences, greedy.sequences)
    top1 = generate(model, prompts, 16, temperature=1.5, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(top1.sequences, greedy.sequences)


def test_top_p_mask_on_hand_made_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert top_p_mask(probs, 0.8).tolist() == [True, True, False, False]
    assert top_p_mask(probs, 0.81).tolist() == [True, True, True, False]
    assert top_p_mask(probs, 0.5).tolist() == [True, False, False, False]
    assert top_p_mask(probs, 0.1).tolist() == [True, False, False, False]  # always at least one
    assert top_p_mask(probs, 1.0).tolist() == [True] * 4
    # unsorted input and a batch of rows
    shuffled = torch.stack([probs[[2, 0, 3, 1]], probs])
    assert top_p_mask(shuffled, 0.8).tolist() == [[False, True, False, True], [True, True, False, False]]
    # applied to logits (not exactly on the boundary)
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, top_p=0.75)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.9)).tolist() == [True, True, True, False]


def test_top_k_mask_and_filter_order():
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    assert top_k_mask(logits, 2).tolist() == [[False, True, False, True, False], [True, True, False, False, False]]
    assert top_k_mask(logits, 10).all()
    ties = torch.zeros(1, 6)
    assert top_k_mask(ties, 3).sum().item() == 3  # exactly k even with ties
    # top-k first, then top-p on the renormalised top-k distribution: [0.5, 0.3] -> [0.625, 0.375]
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), top_k=2, top_p=0.6))
    assert kept.tolist() == [True, False, False, False]


def test_sampling_frequencies_follow_the_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    tokens = sample_next_token(logits, temperature=1.0, top_p=0.8, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=4)
    assert counts[2:].sum() == 0
    assert abs(counts[0].item() / 4000 - 0.625) < 0.03


@pytest.mark.parametrize("name", PRESETS)
def test_eos_stops_a_sequence(name):
    model = _model(name)
    prompts = _prompts()
    free = _greedy(name)
    eos = free.completions[0][3]
    cut = [c[: c.index(eos) + 1] if eos in c else c for c in free.completions]
    out = generate(model, prompts, 16, eos_token_id=eos, pad_token_id=0)
    assert out.completions == cut
    assert out.completions[0][-1] == eos and len(out.completions[0]) <= 4
    n = len(out.completions[0])
    assert out.completion_mask[0].tolist() == [True] * n + [False] * (out.completion_mask.shape[1] - n)
    assert (out.completion_ids[0, n:] == 0).all()
    assert (out.logprobs[0, n:] == 0).all()
    assert out.attention_mask[0, out.prompt_length :].tolist() == out.completion_mask[0].tolist()
    assert torch.equal(out.completion_mask.sum(1), torch.tensor([len(c) for c in out.completions]))
    # cached and uncached stop alike
    assert generate(model, prompts, 16, eos_token_id=eos, use_cache=False).completions == cut

    # several eos ids; generation stops early once every sequence is done
    eos_ids = [c[1] for c in free.completions]
    early = generate(model, prompts, 16, eos_token_id=eos_ids)
    assert all(c[-1] in eos_ids and len(c) <= 2 for c in early.completions)
    assert early.sequences.shape[1] == 12 + max(len(c) for c in early.completions)


def _recording_cache(monkeypatch) -> list[KVCache]:
    made: list[KVCache] = []

    class Recording(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(generation, "KVCache", Recording)
    return made


def test_mla_caches_the_latent(monkeypatch):
    model = _model("deepseek_v3_tiny")
    cfg = model.config
    made = _recording_cache(monkeypatch)
    generate(model, _prompts(), 8)
    (cache,) = made
    assert cache.length == 12 + 8 - 1  # the last sampled token is never fed back
    assert cache.numel_per_token() == cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert cache.numel_per_token() < cfg.n_layers * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)


def test_gqa_caches_keys_and_values(monkeypatch):
    model = _model("deepseek_llm_tiny")
    cfg = model.config
    made = _recording_cache(monkeypatch)
    generate(model, _prompts(), 4)
    assert made[0].numel_per_token() == cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim


def test_exceeding_max_seq_len_raises():
    model = _model("deepseek_llm_tiny")  # max_seq_len=64
    prompts = _prompts((10, 60))
    with pytest.raises(ValueError, match="max_seq_len=64"):
        generate(model, prompts, 5)
    assert generate(model, prompts, 4).sequences.shape == (2, 64)  # exactly fits


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_k=0), "top_k"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(_model("deepseek_llm_tiny"), _prompts(), **kwargs)


def test_empty_prompt_raises():
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(_model("deepseek_llm_tiny"), [[1, 2], []], 2)


@pytest.mark.parametrize("name", PRESETS)
def test_outputs_feed_a_training_forward(name):
    """What GRPO does: restore train mode, recompute the log-probs with gradients from the returned
    sequences, attention_mask and positions_from_mask; they match the sampled logprobs."""
    model = _model(name)
    model.train()
    try:
        out = generate(model, _prompts(), 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
        assert model.training
        mask = out.attention_mask
        logits = model(out.sequences, positions_from_mask(mask), mask)
        start = out.prompt_length
        logprobs = logits[:, start - 1 : -1].float().log_softmax(-1)
        logprobs = logprobs.gather(-1, out.completion_ids[..., None]).squeeze(-1) * out.completion_mask
        assert_close_fp32(logprobs.detach(), out.logprobs, REDUCTION)
        logprobs.sum().backward()  # the returned tensors are not inference tensors
        assert model.output.weight.grad is not None
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
