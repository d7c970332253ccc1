"""The deepseek_v32 family (DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention): logits equal to
transformers' ``DeepseekV32ForCausalLM`` both ways, the indexer's selection against a written-out
reference, cached decoding, and what the language-model loss does (not) train.

The tiny random model (fp32) keeps 8 keys per query over 24-token sequences, so 15 of every row's
24 queries attend to a strict subset of their causal keys: a model that ignored the selection (or
selected other keys) gives other logits, which the parity tests also assert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

from data_contract.errors import ConfigError
from dsl_lit.hf import from_pretrained, save_pretrained
from dsl_lit.inference.generation import generate
from dsl_lit.models import ModelConfig, Transformer, build_model
from dsl_lit.models.common.dsa import SparseLatentAttention
from tests.numerics import assert_close_fp32
from tests.unit.hf.test_hf_interop_v3 import _hf_load, _randomise, _weights

VOCAB, D, LAYERS, HEADS, FFN, MOE_FFN, EXPERTS, TOP_K = 256, 64, 3, 4, 96, 32, 8, 2
INDEX_HEADS, INDEX_DIM, INDEX_TOPK, SEQ = 4, 16, 8, 24

OVERRIDES = dict(
    vocab_size=VOCAB, n_layers=LAYERS, d_model=D, n_heads=HEADS, n_kv_heads=HEADS, ffn_hidden=FFN, max_seq_len=64,
    rope_theta=5000.0, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_dense_layers=1, n_routed_experts=EXPERTS, n_shared_experts=1, n_activated_experts=TOP_K, moe_ffn_hidden=MOE_FFN,
    n_expert_groups=2, n_limited_groups=1, route_scale=2.5, mtp_depth=0, attn_backend="eager",
    index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=INDEX_TOPK,
)


def _ours(**overrides: object) -> Transformer:
    model = build_model(ModelConfig.from_name("deepseek_v32_tiny", **{**OVERRIDES, **overrides})).eval()
    _randomise(model)
    return model


def _hf_model() -> DeepseekV32ForCausalLM:
    cfg = DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, moe_intermediate_size=MOE_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1, n_routed_experts=EXPERTS,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=TOP_K, first_k_dense_replace=1,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=INDEX_TOPK, bos_token_id=0, eos_token_id=1,
    )
    cfg._attn_implementation = "eager"
    model = DeepseekV32ForCausalLM(cfg).eval()
    _randomise(model)
    return model


def _ids(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, DeepseekV32ForCausalLM):
        return model(input_ids=ids).logits.float()
    return model(ids).float()


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close_fp32(actual, expected, D * LAYERS * SEQ)  # fp32 reordering over width, layers, keys


def test_hf_to_ours_logits_match_and_write_back(tmp_path: Path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ours, cfg = from_pretrained(tmp_path / "hf", attn_backend="eager")
    assert cfg.family == "deepseek_v32"
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (INDEX_HEADS, INDEX_DIM, INDEX_TOPK)
    assert isinstance(ours.layers["0"].attention, SparseLatentAttention)
    ids = _ids(seed=2)
    expected = _logits(hf, ids)
    _close(_logits(ours, ids), expected)
    _close(_logits(from_pretrained(tmp_path / "hf", attn_backend="sdpa")[0], ids), expected)
    # the selection matters: attending to every causal key gives other logits
    dense = _ours(index_topk=SEQ)
    dense.load_state_dict(ours.state_dict())
    assert (_logits(dense, ids) - expected).abs().max() > 1e-2
    save_pretrained(ours, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("deepseek_v32", ["DeepseekV32ForCausalLM"])
    assert (written["index_n_heads"], written["index_head_dim"], written["index_topk"]) == (INDEX_HEADS, INDEX_DIM, INDEX_TOPK)
    original, back = _weights(tmp_path / "hf"), _weights(tmp_path / "back")
    assert any(".indexer.wq_b." in k for k in original) and original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_ours_to_hf_logits_match(tmp_path: Path):
    ours = _ours()
    save_pretrained(ours, tmp_path)
    hf = _hf_load(tmp_path)
    assert isinstance(hf, DeepseekV32ForCausalLM)
    ids = _ids()
    _close(_logits(hf, ids), _logits(ours, ids))


def _reference_scores(attn: SparseLatentAttention, x: torch.Tensor, rope) -> list[list[list[float]]]:
    """Per query and causal key, in Python loops from DeepSeek-V3.2's formula:
    I[t, s] = sum_h w[t, h] / sqrt(H) * ReLU(q[t, h] . k[s] / sqrt(D))."""
    ix = attn.indexer
    cos, sin = rope
    batch, seq, _ = x.shape
    q = ix._rotate(ix.wq_b(attn.q_norm(attn.wq_a(x))).view(batch, seq, ix.n_heads, ix.head_dim), cos, sin)
    k = ix.keys(x, cos, sin)[:, :, 0]
    w = ix.weights_proj(x) * ix.n_heads**-0.5
    return [[[sum(float(w[b, t, h]) * max(0.0, float(q[b, t, h] @ k[b, s]) * ix.head_dim**-0.5)
                  for h in range(ix.n_heads)) for s in range(t + 1)] for t in range(seq)] for b in range(batch)]


@torch.no_grad()
def test_the_indexer_selects_the_keys_of_highest_score():
    """Each query keeps min(index_topk, its causal keys) keys, and none it dropped scores higher than
    one it kept (ties, e.g. keys every head's ReLU zeroes, may go either way)."""
    model = _ours()
    attn = model.layers["1"].attention
    x = torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(3))
    rope = model.rope(SEQ, 0, None)
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None]
    q_latent = attn.q_norm(attn.wq_a(x))
    keys = attn.indexer.keys(x, *rope)
    selected = attn.select(x, q_latent, keys, *rope, allowed)
    reference = _reference_scores(attn, x, rope)
    ours = attn.indexer.scores(x, q_latent, keys, *rope)
    for b in range(2):
        for t in range(SEQ):
            torch.testing.assert_close(ours[b, t, :t + 1], torch.tensor(reference[b][t]), rtol=1e-5, atol=1e-6)
            kept = selected[b, t].nonzero().flatten().tolist()
            assert len(kept) == min(INDEX_TOPK, t + 1) and max(kept) <= t  # causal
            dropped = [s for s in range(t + 1) if s not in kept]
            if dropped:
                scale = max(1.0, max(abs(v) for v in reference[b][t]))  # fp32 scores vs these float64 sums
                assert min(reference[b][t][s] for s in kept) >= max(reference[b][t][s] for s in dropped) - 1e-5 * scale


def test_cached_decoding_equals_recomputing_and_the_lm_loss_leaves_the_indexer_alone():
    model = _ours()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22]]
    cached = generate(model, prompts, max_new_tokens=12, use_cache=True)
    recomputed = generate(model, prompts, max_new_tokens=12, use_cache=False)
    assert [list(map(int, s)) for s in cached.sequences] == [list(map(int, s)) for s in recomputed.sequences]
    model.train()
    logits = model(_ids())
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), _ids().flatten()).backward()
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    assert indexer and all(p.grad is None for p in indexer)
    assert model.layers["1"].attention.wq_a.weight.grad is not None


def test_671b_preset_and_config_errors():
    with torch.device("meta"):
        model = build_model(ModelConfig.from_name("deepseek_v32_671b"))
        v3 = build_model(ModelConfig.from_name("deepseek_v3_671b"))
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64  # wq_b, wk, k_norm, weights_proj
    assert model.num_params() - v3.num_params() == per_layer * 61  # 671.9B: V3's 671.0B and 61 indexers
    assert model.num_params(include_mtp=True) - v3.num_params(include_mtp=True) == per_layer * 62  # + the MTP block's
    with pytest.raises(ConfigError, match=r"^model\.q_lora_rank=null: DeepSeek Sparse Attention"):
        ModelConfig.from_name("deepseek_v32_tiny", q_lora_rank=None)
    with pytest.raises(ConfigError, match=r"^model\.index_topk=0 must be a positive integer"):
        ModelConfig.from_name("deepseek_v32_tiny", index_topk=0)
    with pytest.raises(ConfigError, match=r"^model\.index_topk is not used by model\.name=deepseek_v3_tiny .*lightning indexer"):
        ModelConfig.from_name("deepseek_v3_tiny").refuse_unused(["index_topk"])


# -- training the indexer (DeepSeek-V3.2-Exp, section 2.1) ---------------------------------------------


def _index_objective(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(LM loss, indexer KL summed over layers, mean top-k recall) of one training forward."""
    logits = model(ids[:, :-1])
    lm = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    kl, recall = model.index_losses()
    return lm, kl, recall


def test_the_warmup_trains_the_indexer_towards_the_attention_and_raises_recall():
    """Dense attention, every weight but the indexers' frozen (as the module freezes them): the KL to
    the main attention falls and the top-k's share of the dense attention mass rises."""
    torch.manual_seed(0)
    model = _ours(index_training="warmup").train()
    with torch.no_grad():  # peaked attention, as a trained model's (a random one's is nearly flat: nothing to find)
        for name, p in model.named_parameters():
            if name.endswith(("attention.wq_b.weight", "attention.wkv_b.weight")):
                p.mul_(3.0)
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." in name)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(5))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    history = []
    for _ in range(40):
        lm, kl, recall = _index_objective(model, ids)
        kl.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append((float(kl.detach()), float(recall), float(lm.detach())))
    (kl0, recall0, lm0), (kl1, recall1, lm1) = history[0], history[-1]
    assert kl1 < 0.2 * kl0, history  # measured: 1.23 -> 0.12
    assert recall1 > recall0 + 0.1, (recall0, recall1)  # measured: 0.70 -> 0.88
    assert lm1 == lm0  # dense attention and frozen weights: the language model did not change
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_sparse_training_the_lm_loss_trains_the_model_and_the_kl_the_indexer():
    model = _ours(index_training="sparse").train()
    ids = _ids(seq=SEQ + 1)
    lm, kl, recall = _index_objective(model, ids)
    assert 0 < float(recall) < 1  # 8 of up to 24 keys hold part of the dense attention mass
    lm.backward(retain_graph=True)
    indexer = {n for n, _ in model.named_parameters() if ".indexer." in n}
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[n] is None for n in indexer) and grads["layers.1.attention.wq_a.weight"] is not None
    model.zero_grad(set_to_none=True)
    kl.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == indexer  # the indexer's input is detached: its KL reaches nothing else
    # the KL of one layer against a reference: the main attention over the selected keys, mean over heads
    attn = model.layers["1"].attention
    assert attn.index_loss is not None and float(attn.index_loss) > 0


def test_a_v3_checkpoint_continues_as_v32_with_its_indexers_added(tmp_path: Path):
    """init_from a DeepSeek-V3 checkpoint with a deepseek_v32 model: the architecture is the
    checkpoint's, the indexers are added (random init), every other tensor is read."""
    from dsl_lit.training.pretrained import StartingWeights

    v3 = build_model(ModelConfig.from_name("deepseek_v3_tiny", **{k: v for k, v in OVERRIDES.items()
                                                                     if not k.startswith("index_")}))
    _randomise(v3)
    save_pretrained(v3, tmp_path / "v3")
    run = ModelConfig.from_name("deepseek_v32_tiny", index_topk=SEQ, index_training="warmup")
    weights = StartingWeights.open(tmp_path / "v3").continued_as(run)
    assert weights.config.family == "deepseek_v32" and weights.config.d_model == D  # the checkpoint's shape
    assert (weights.config.index_topk, weights.config.index_training) == (SEQ, "warmup")  # the run's
    model = weights.whole_model()
    ids = _ids()
    v3.eval(), model.eval()
    _close(_logits(model, ids), _logits(v3, ids))  # every key kept (topk >= SEQ): V3's logits
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in v3.state_dict().items())
    assert loaded["layers.0.attention.indexer.k_norm.weight"].eq(1).all()
    assert loaded["layers.0.attention.indexer.wk.weight"].std() > 0


def test_every_layout_is_accepted_at_start_up(compose_cfg):
    """tensor, expert, pipeline and context parallelism and their product validate for V3.2 (its
    parity under each: tests/e2e/parallel/test_tensor_parallel.py, test_expert_parallel.py,
    test_pipeline.py, test_context_parallel.py)."""
    from dsl_lit.config import TrainConfig

    for devices, layout in ((2, ["parallel.tp=2"]), (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                            (2, ["parallel=ep"]), (2, ["parallel=pp_1f1b", "data.micro_batch_size=1"]),
                            (2, ["parallel=cp2"]), (4, ["parallel.tp=2", "parallel=ep"])):
        cfg = TrainConfig.from_hydra(compose_cfg(overrides=["model=deepseek_v32_tiny", f"trainer.devices={devices}", *layout]))
        assert cfg.layout.world_size == devices


def test_the_warmup_without_a_checkpoint_is_refused_at_start_up(compose_cfg):
    """Training the indexers of a random model against its random attention, the rest frozen, would
    train on nothing: one line naming init_from (the experiment leaves it for the command line)."""
    from dsl_lit.config import TrainConfig

    with pytest.raises(ConfigError, match=r"^model\.index_training=warmup trains only the indexers.*set init_from"):
        TrainConfig.from_hydra(compose_cfg(overrides=["experiment=cpu_dsa_warmup"]))
    TrainConfig.from_hydra(compose_cfg(overrides=["experiment=cpu_dsa_warmup", "init_from=outputs/pretrain/x"]))


def test_flops_count_the_indexer_and_top_k_attention_not_dense_attention():
    """At 128K tokens DSA's attention costs the indexer's scores plus MLA over 2048 keys: far below
    V3's dense attention; at 2048 tokens or fewer every key is kept and the indexer costs extra."""
    from dsl_lit.flops import training_flops_per_token

    v32, v3 = ModelConfig.from_name("deepseek_v32_671b"), ModelConfig.from_name("deepseek_v3_671b")
    blocks = 61 + 1
    indexer = 3 * blocks * 2.0 * 64 * (128 + 1) * 131072 + 6 * (1536 * 64 * 128 + 7168 * (128 + 64)) * blocks
    dense_minus_topk = 3 * blocks * 2.0 * 128 * (192 + 128) * (131072 - 2048)
    delta = training_flops_per_token(v3, 131072) - training_flops_per_token(v32, 131072)
    assert delta == pytest.approx(dense_minus_topk - indexer, rel=1e-12)
    assert training_flops_per_token(v32, 131072) < 0.5 * training_flops_per_token(v3, 131072)
    assert training_flops_per_token(v32, 2048) > training_flops_per_token(v3, 2048)


@torch.no_grad()
def test_greedy_continuations_equal_transformers(tmp_path: Path):
    """KV-cache decoding on both sides (transformers caches the indexer's keys too): the same tokens."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path, attn_backend="eager")
    prompt = _ids(seed=4)[0, :12]
    expected = hf.generate(prompt[None], max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                           min_new_tokens=16)[0, 12:].tolist()
    got = generate(ours, [prompt.tolist()], max_new_tokens=16).sequences[0]
    assert [int(t) for t in got][-16:] == expected, (got, expected)


def test_fp8_export_stores_the_indexer_projections_as_the_release_does(tmp_path: Path):
    """DeepSeek's FP8 release quantises the indexer's wq_b and wk (128x128 blocks, scales beside them)
    and keeps k_norm and weights_proj: written so, and read back as their dequantised values."""
    from safetensors import safe_open

    from dsl_lit.hf import adapter_for_family
    from tests.unit.hf.test_hf_fp8 import E4M3, _config, _dequantise, _model

    model = _model(_config(family="deepseek_v32", index_n_heads=2, index_head_dim=128, index_topk=8))
    save_pretrained(model, tmp_path, max_shard_size="200KB", fp8=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for name, file in index.items():
        with safe_open(str(tmp_path / file), framework="pt") as f:
            stored[name] = f.get_tensor(name)
    prefix = "model.layers.0.self_attn.indexer."
    assert stored[prefix + "wq_b.weight"].dtype == E4M3 and stored[prefix + "wk.weight"].dtype == E4M3
    assert prefix + "wq_b.weight_scale_inv" in stored and prefix + "weights_proj.weight_scale_inv" not in stored
    assert stored[prefix + "k_norm.bias"].dtype != E4M3 and stored[prefix + "weights_proj.weight"].dtype != E4M3
    back, cfg = from_pretrained(tmp_path, attn_backend="eager")
    assert cfg.family == "deepseek_v32"
    back_hf = adapter_for_family("deepseek_v32").to_hf(back.state_dict(), back.config)
    for name in ("wq_b.weight", "wk.weight"):
        assert torch.equal(back_hf[prefix + name], _dequantise(stored[prefix + name], stored[prefix + name + "_scale_inv"]))
