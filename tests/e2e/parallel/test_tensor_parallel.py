"""Tensor-parallel plans on real gloo meshes (2 and 4 ranks): sharded models give the single-device
logits, losses (main, MTP, MoE balance), MTP logits, gradients and gradient norm for every family
(MLA with and without query compression, MoE, MTP, DeepSeek-V3.2's indexer: its KL and top-k
recall; DeepSeek-V4's shared key/value head, compressors, sinks and grouped output projection),
with and without sequence parallelism, with
a vocab-parallel embedding (tied or not), and with kv heads replicated when tp > n_kv_heads. The
vocab-parallel cross-entropy never needs the gathered logits, and checkpoints (full tensors by
name) round-trip through the sharded layout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from dsl_lit.models import ModelConfig, build_model
from dsl_lit.models.registry import family_spec
from dsl_lit.ops import cross_entropy
from dsl_lit.optim.clip import squared_norm
from dsl_lit.parallel.tensor_parallel import apply_tensor_parallel, declared_plan, tensor_parallel_plan
from tests.numerics import assert_close_fp32, fp32_tolerance
from tests.ranks import spawn

LLM = ("deepseek_llm_tiny", dict(n_layers=2, vocab_size=256))
V3 = ("deepseek_v3_tiny", dict(n_layers=3, vocab_size=256, seq_balance_alpha=0.01))  # dense, MoE, MTP (MoE)
V3_NO_Q_LORA = (V3[0], dict(V3[1], q_lora_rank=None))
V2 = ("deepseek_v2_tiny", dict(n_layers=3, vocab_size=256, seq_balance_alpha=0.01))  # V3's plan, V2's router
# DeepSeek-V3.2: the indexer replicated, its KL target the attention of all heads (summed over tp);
# top-8 of up to 16 keys, so the selection matters, sparse training and the dense warm-up
V32 = ("deepseek_v32_tiny", dict(n_layers=3, vocab_size=256, seq_balance_alpha=0.01, index_topk=8, index_training="sparse"))
V32_WARMUP = (V32[0], dict(V32[1], index_training="warmup"))
# DeepSeek-V4 (mHC streams; hca, sliding, csa layers; hash and top-k routed MoE): query heads and
# whole output groups per rank, the shared key/value head and compressed keys replicated, the CSA
# indexer (top-2 of 4 compressed keys) replicated with its KL target over every rank's heads
V4 = ("deepseek_v4_tiny", dict(vocab_size=256, index_topk=2))

# (preset, overrides, sequence_parallel); 16 input tokens: divisible by tp, the MTP's 15 are not
TP2_CASES = [
    (*LLM, False),
    (*V3, False),
    (*V3_NO_Q_LORA, False),
    (LLM[0], dict(LLM[1], tie_embeddings=True), False),
    (LLM[0], dict(LLM[1], n_kv_heads=1), False),  # tp=2 > n_kv_heads: the kv head replicated
    (*LLM, True),
    (*V3, True),
    (*V3_NO_Q_LORA, True),
    (*V2, True),
    (LLM[0], dict(LLM[1], n_kv_heads=1), True),
    (*V32, False),
    (*V32, True),
    (*V32_WARMUP, False),
    (*V4, False),
]
TP4_CASES = [
    (LLM[0], dict(LLM[1], n_kv_heads=2), True),  # ranks 0, 1 use kv head 0; ranks 2, 3 kv head 1
    (LLM[0], dict(LLM[1], n_kv_heads=2), False),
]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


Outputs = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor | None]


def _run(model: torch.nn.Module, tokens: torch.Tensor) -> Outputs:
    """(hidden states, logits, MTP logits, the pretraining objective, the indexers' mean top-k
    recall or None) as the modules compute them (the objective with DeepSeek-V3.2's indexer KL, which
    trains the indexers only); the logits are copies, as cross_entropy's backward writes their
    gradient over local logits."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    hidden = model.hidden_states(inputs)
    logits = model.head(hidden)
    mtp = model.mtp_logits(hidden, inputs)
    loss = cross_entropy(logits, labels)
    for k, mtp_logits in enumerate(mtp, start=1):
        loss = loss + cross_entropy(mtp_logits, labels[:, k:])
    balance, index = model.balance_loss(), model.index_losses()
    logits, mtp = logits.detach().clone(), [m.detach().clone() for m in mtp]
    loss = loss if balance is None else loss + balance
    return hidden, logits, mtp, loss if index is None else loss + index[0], None if index is None else index[1]


def _check_case(mesh: DeviceMesh, name: str, overrides: dict, sequence_parallel: bool) -> None:
    world = mesh.size()
    case = f"{name} {overrides} sp={sequence_parallel} tp={world}"
    cfg = ModelConfig.from_name(name, **overrides)
    torch.manual_seed(0)
    reference = build_model(cfg)
    torch.manual_seed(0)
    sharded = apply_tensor_parallel(build_model(cfg), cfg, mesh, sequence_parallel=sequence_parallel)
    assert any(isinstance(p, DTensor) for p in sharded.layers["1"].attention.parameters())
    embedding = sharded.tok_embeddings.weight
    assert isinstance(embedding, DTensor) and embedding.placements == (Shard(0),)  # vocab-parallel
    assert embedding.to_local().shape[0] == cfg.vocab_size // world
    if cfg.tie_embeddings:
        assert sharded.output.weight is embedding
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    _, expected_logits, expected_mtp, expected, expected_recall = _run(reference, tokens)
    expected.backward()
    with loss_parallel():
        hidden, logits, mtp, loss, recall = _run(sharded, tokens)
        loss.backward()
    if sequence_parallel:  # the residual stream is sequence shards, the rotary tables were full
        assert isinstance(hidden, DTensor) and hidden.placements == (Shard(1),), case
        assert hidden.shape[1] == 16 and hidden.to_local().shape[1] == 16 // world, case
    else:
        assert not isinstance(hidden, DTensor), case
    assert isinstance(logits, DTensor) and logits.placements[0].is_shard(dim=logits.ndim - 1), case
    assert logits.to_local().shape[-1] == cfg.vocab_size // world, case  # never gathered
    assert len(mtp) == len(expected_mtp) == cfg.mtp_modules
    reduction = cfg.d_model * cfg.n_layers  # per layer one sum over the model width, split over tp
    assert_close_fp32(loss, expected, reduction, msg=f"{case} loss")
    if cfg.index_training != "off":  # every rank selected the keys one process selects
        assert 0 < float(recall) < 1, case
        assert_close_fp32(recall, expected_recall, reduction, msg=f"{case} top-k recall")
    assert_close_fp32(_full(logits), expected_logits, reduction, msg=f"{case} logits")
    for got, want in zip(mtp, expected_mtp):
        assert_close_fp32(_full(got), want, reduction, msg=f"{case} MTP logits")
    grads = dict(reference.named_parameters())
    for param_name, p in sharded.named_parameters():
        if isinstance(p.grad, DTensor):  # what the gradient norm and the dp reduction rely on
            assert not any(pl.is_partial() for pl in p.grad.placements), f"{case} {param_name}"
        want = grads[param_name].grad
        if ".indexer." in param_name:
            # an indexer's gradients all come from one source, softmax(I) - p over the keys, p the
            # attention's mean over heads (summed in another order under tp); its key norm's bias
            # gets a near-cancelling sum of those (the softmax ignores a shift shared by every key), so
            # each of its tensors carries the error of the module's gradient scale, not of its own
            module = param_name.rsplit(".indexer.", 1)[0] + ".indexer."
            scale = max(g.grad.abs().max().item() for n, g in grads.items() if n.startswith(module))
            tolerance = fp32_tolerance(torch.tensor([scale]), reduction)
            torch.testing.assert_close(_full(p.grad), want, **tolerance, msg=lambda m, n=param_name: f"{case} {n}: {m}")
            continue
        # a scalar (V4's stream collapse scale) sums its gradient over every token, stream and feature
        terms = tokens[:, :-1].numel() * cfg.d_model * (cfg.hc_mult if cfg.family == "deepseek_v4" else 1)
        assert_close_fp32(_full(p.grad), want, terms if want.numel() == 1 else reduction, msg=f"{case} {param_name}")
    norm = squared_norm([p.grad for p in sharded.parameters()])
    expected_norm = squared_norm([p.grad for p in reference.parameters()])
    assert_close_fp32(norm, expected_norm, reduction, msg=f"{case} grad norm")
    # checkpoints: full tensors under the single-device names, loaded back by re-distributing them
    state = {k: _full(v) for k, v in sharded.state_dict().items()}
    reference_state = reference.state_dict()
    assert state.keys() == reference_state.keys(), case
    for key, value in state.items():
        torch.testing.assert_close(value, reference_state[key], atol=0, rtol=0,
                                   msg=lambda m, k=key: f"{case} {k}: {m}")
    torch.manual_seed(1)  # different weights until the checkpoint is loaded
    restored = apply_tensor_parallel(build_model(cfg), cfg, mesh, sequence_parallel=sequence_parallel)
    own = restored.state_dict()
    restored.load_state_dict({
        k: distribute_tensor(v, own[k].device_mesh, own[k].placements) if isinstance(own[k], DTensor) else v
        for k, v in state.items()
    })
    with torch.no_grad(), loss_parallel():
        assert_close_fp32(_full(restored(tokens[:, :-1])), expected_logits, reduction, msg=f"{case} restored")


def _worker(rank: int, world: int, init_file: str, cases: list) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for name, overrides, sequence_parallel in cases:
            _check_case(mesh, name, overrides, sequence_parallel)
        if world == 2:  # the op itself: vocab-parallel loss and gradient equal the plain ones
            full = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
            targets = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(3))
            targets[0, 0] = -100
            plain = cross_entropy(full, targets)
            plain.backward()
            logits = distribute_tensor(full.detach(), mesh, [Shard(-1)]).requires_grad_()
            with loss_parallel():
                loss = cross_entropy(logits, targets)
                loss.backward()
            assert not isinstance(loss, DTensor)
            torch.testing.assert_close(loss, plain)
            torch.testing.assert_close(logits.grad.full_tensor(), full.grad)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world, cases", [(2, TP2_CASES), (4, TP4_CASES)], ids=["tp2", "tp4"])
def test_tensor_parallel_matches_one_device(tmp_path, world, cases):
    spawn(_worker, args=(world, str(tmp_path / "init"), cases), nprocs=world)


@pytest.mark.parametrize("name", ["deepseek_llm_tiny", "deepseek_v3_tiny", "deepseek_v2_tiny", "deepseek_v32_tiny",
                                  "deepseek_v4_tiny"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_family_declares_its_plan_in_known_styles(name, sequence_parallel):
    """A family's plan is data (FQN -> style name) that names only modules (or, for per-head
    parameters, parameters) the model has; every name becomes a ParallelStyle, except the gradient
    hooks (MLA's shared rotary key, V4's key/value head and compressed keys) and V4's sinks."""
    cfg = ModelConfig.from_name(name, n_layers=4 if name == "deepseek_v4_tiny" else 2)
    if name == "deepseek_v4_tiny" and sequence_parallel:  # refused at start-up (its card), and here
        with pytest.raises(ValueError, match="no sequence parallelism"):
            declared_plan(cfg, 2, sequence_parallel)
        return
    declared = declared_plan(cfg, 2, sequence_parallel)
    assert declared == family_spec(cfg.family).tp_plan(cfg, 2, sequence_parallel)
    with torch.device("meta"):
        model = build_model(cfg)
    modules, parameters = {n for n, _ in model.named_modules()}, {n for n, _ in model.named_parameters()}
    assert {n for n, style in declared.items() if style != "head_sharded"} <= modules
    assert {n for n, style in declared.items() if style == "head_sharded"} <= parameters
    styles = tensor_parallel_plan(cfg, 2, sequence_parallel)
    hooks = {n for n, style in declared.items() if style in ("shared_rope_key", "shared_by_heads", "head_sharded")}
    assert set(styles) == set(declared) - hooks
    if name == "deepseek_v4_tiny":  # kinds hca, sliding, csa, hca: the sliding layer has no compressor
        assert {n for n in hooks if "compressor" in n} == {f"layers.{i}.attention.compressor.norm" for i in (0, 2, 3)}
        assert {n for n in hooks if n.endswith("attn_sink")} == {f"layers.{i}.attention.attn_sink" for i in range(4)}
    else:
        assert hooks == ({"layers.0.attention.wkv_a", "layers.1.attention.wkv_a"}
                         | ({"mtp.0.block.attention.wkv_a"} if cfg.mtp_modules else set())
                         if cfg.attention.latent else set())
    assert ("norm" in declared) == sequence_parallel
