"""Big-model loading: the model is built on the meta device, cut down to what a rank holds
(pipeline stages, tensor shards, experts), and each rank reads only its tensors (their regions)
straight from the safetensors files; ``init_from`` trains from them under any layout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dsl_lit.config.optim import OptimConfig, ScheduleConfig
from dsl_lit.hf import adapter_for_family, from_pretrained, save_pretrained
from dsl_lit.models import ModelConfig, build_model
from dsl_lit.parallel.expert_parallel import apply_expert_parallel
from dsl_lit.parallel.pipeline import prune_to_stages, split_layers
from dsl_lit.parallel.tensor_parallel import apply_tensor_parallel
from dsl_lit.training import PretrainModule
from dsl_lit.training.pretrained import StartingWeights
from dsl_lit.utils.materialise import local_target
from tests.conftest import scratch_dir
from tests.ranks import spawn
from tests.recipe_runs import losses, run_recipe

# MLA + MoE with an MTP module; dims that are not multiples of 128, so tensor shards start inside
# FP8 blocks (wq_b: 4 heads x 48 rows, 96 per tp rank)
V3 = dict(family="deepseek_v3", vocab_size=256, n_layers=3, d_model=192, n_heads=4, n_kv_heads=4,
          ffn_hidden=320, max_seq_len=64, q_lora_rank=160, kv_lora_rank=64, qk_nope_head_dim=32,
          qk_rope_head_dim=16, v_head_dim=48, n_dense_layers=1, n_routed_experts=4, n_shared_experts=1,
          n_activated_experts=2, moe_ffn_hidden=160, n_expert_groups=2, n_limited_groups=1,
          score_func="sigmoid", route_scale=1.5, norm_topk_prob=True, mtp_depth=1)
# grouped-query attention with one kv head (replicated over tp) and a tied head
LLM = dict(family="deepseek_llm", vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=1,
           ffn_hidden=96, max_seq_len=64, tie_embeddings=True)
# DeepSeek-V2 (softmax routing, no balancing bias in the checkpoint: zeros)
V2 = dict(V3, family="deepseek_v2", score_func="softmax", q_lora_rank=None, n_expert_groups=1,
          n_limited_groups=1, norm_topk_prob=False, mtp_depth=0, route_scale=1.0)


# DeepSeek-V4 (mHC, compressed attention, hash and top-k routing): its release stores the routed experts
# in FP4, two values a byte in 1x32 groups, so an expert-parallel rank reads its experts' bytes
V4 = dict(vocab_size=256, d_model=64, n_heads=4, attention_head_dim=32, q_lora_rank=24, qk_rope_head_dim=8,
          moe_ffn_hidden=64, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=3,
          sliding_window=8, hca_rate=16, n_layers=4, attention_kinds=["hca", "sliding", "csa", "hca"], n_hash_layers=1)


def _random(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias") and cfg.score_func == "sigmoid":
                b.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("family", [V3, LLM, V2], ids=["deepseek_v3", "deepseek_llm", "deepseek_v2"])
def test_hf_sources_name_what_to_hf_writes(family: dict) -> None:
    """Each of our tensors, rebuilt from the HF tensors ``hf_sources`` names (stacked per expert,
    zeros where HF stores nothing), is the tensor: the lazy reader and ``from_hf`` agree."""
    cfg = ModelConfig(**family)
    state = _random(cfg).state_dict()
    adapter = adapter_for_family(cfg.family)
    hf = adapter.to_hf(state, cfg)
    for name, source in adapter.hf_sources(state, cfg).items():
        if not source.names:
            rebuilt = torch.zeros_like(state[name])
        elif source.stacked:
            rebuilt = torch.stack([hf[n] for n in source.names])
        else:
            (hf_name,) = source.names
            rebuilt = hf[hf_name]
        assert torch.equal(rebuilt, state[name]), name


def test_a_pipeline_stage_reads_only_its_tensors(tmp_path: Path) -> None:
    cfg = ModelConfig(**V3)
    save_pretrained(_random(cfg), tmp_path)
    full = from_pretrained(tmp_path)[0].state_dict()
    weights = StartingWeights.open(tmp_path)
    with torch.device("meta"):
        stage = build_model(weights.config)
    prune_to_stages(stage, split_layers(weights.config, 2), [1])
    weights.load(stage, "cpu")
    held = stage.state_dict()
    assert "tok_embeddings.weight" not in held and "layers.0.attention.wq_a.weight" not in held
    assert "mtp.0.eh_proj.weight" in held
    for name, tensor in held.items():
        assert torch.equal(tensor, full[name]), name
    total = sum(t.numel() * t.element_size() for t in full.values())
    assert weights.hf.bytes_read == sum(t.numel() * t.element_size() for t in held.values()) < total


def test_init_from_on_one_process_reads_the_whole_model(tmp_path: Path) -> None:
    """No trainer (one device): ``configure_model`` reads the starting weights whole, in fp32."""
    cfg = ModelConfig(**V2)
    save_pretrained(_random(cfg), tmp_path, dtype="bfloat16")
    weights = StartingWeights.open(tmp_path)
    module = PretrainModule(weights.config, OptimConfig(), ScheduleConfig(), micro_batch_size=1, total_steps=1,
                            initial_state=weights)
    module.configure_model()
    reference = from_pretrained(tmp_path, dtype="float32")[0].state_dict()
    assert module.initial_state is None
    for name, tensor in module.model.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name



# -- several processes ---------------------------------------------------------------------------


def _check_layout(rank: int, path: Path, layout: str) -> None:
    """Cut a meta model down as ``layout`` does on this rank, read it, compare with the full model."""
    weights = StartingWeights.open(path)
    cfg = weights.config
    full = from_pretrained(path, dtype="float32")[0].state_dict()
    with torch.device("meta"):
        model = build_model(cfg)
    if layout == "pp":
        prune_to_stages(model, split_layers(cfg, 2), [rank])
    elif layout == "ep":
        apply_expert_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    else:
        apply_tensor_parallel(model, cfg, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), hook_gradients=False)
    before = weights.hf.bytes_read
    weights.load(model, "cpu")
    held = 0
    for name, tensor in model.state_dict().items():
        local, offsets = local_target(tensor)
        region = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
        assert torch.equal(local, full[name][region]), (path.name, layout, rank, name)
        held += local.numel() * local.element_size()
    read = weights.hf.bytes_read - before
    total = sum(t.numel() * t.element_size() for t in full.values())
    assert held < total and read < total, (path.name, layout, rank, held, read, total)  # never the whole
    # exactly its own tensors, except: FP8 reads whole blocks, a tied head reads nothing more, and a
    # shard along a later dim (tp's row-parallel weights) reads the full rows it spans
    if not weights.hf.fp8 and not cfg.tie_embeddings and layout != "tp":
        assert read == held, (path.name, layout, rank)


def _worker(rank: int, init_file: str, directories: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        for directory in directories:
            path = Path(directory)
            layouts = ("pp", "ep", "tp") if "moe" in path.name else ("pp", "tp")
            for layout in layouts:
                _check_layout(rank, path, layout)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_rank_reads_its_slice(tmp_path: Path) -> None:
    """Under pp=2, ep=2 and tp=2 every rank's tensors equal its slices of the full model, read from
    fp32, FP8 (shards starting inside blocks), tied-GQA and DeepSeek-V4 FP4-expert checkpoints."""
    v3 = _random(ModelConfig(**V3))
    save_pretrained(v3, tmp_path / "moe")
    save_pretrained(v3, tmp_path / "moe_fp8", fp8=True)
    save_pretrained(_random(ModelConfig(**LLM)), tmp_path / "gqa_tied")
    save_pretrained(_random(ModelConfig.from_name("deepseek_v4_tiny", **V4)), tmp_path / "moe_v4_fp4", fp8=True)
    directories = [str(tmp_path / name) for name in ("moe", "moe_fp8", "gqa_tied", "moe_v4_fp4")]
    spawn(_worker, args=(str(tmp_path / "init"), directories), nprocs=2)


RUN = ["logger=csv", "trainer.accelerator=cpu", "checkpoint.every_minutes=0", "checkpoint.async_save=false",
       "trainer.max_steps=1", "checkpoint.every_n_steps=1"]
LAYOUTS = {"single": [], "pp2": ["trainer.devices=2", "parallel=pp_1f1b"], "ep2": ["trainer.devices=2", "parallel=ep"]}


@pytest.fixture(scope="module")
def hf_runs(request: pytest.FixtureRequest) -> Path:
    """One step of the pretrain recipe from an HF directory, on one process, pp=2 and ep=2."""
    root = scratch_dir(request, "init_from_hf")
    cfg = ModelConfig.from_name("deepseek_v3_tiny", n_layers=2)
    save_pretrained(_random(cfg), root / "hf")
    for name, layout in LAYOUTS.items():
        run_recipe(root / name, *RUN, f"init_from={root / 'hf'}", *layout)
    return root


@pytest.mark.slow
def test_init_from_hf_under_pp2_and_ep2_matches_one_process(hf_runs: Path) -> None:
    """Pipeline and expert parallel ranks read only their parts (each rank's log says what it
    holds) and score the first batch as one process does."""
    runs = {name: float(losses(hf_runs / name)[0]) for name in LAYOUTS}
    held = {}
    for name in LAYOUTS:
        log = "".join(p.read_text() for p in (hf_runs / name).glob("*.log"))  # one file per rank
        held[name] = sorted(float(g) for g in re.findall(r"this process holds ([\d.]+) MiB", log))
    assert runs["pp2"] == pytest.approx(runs["single"], rel=1e-5)
    assert runs["ep2"] == pytest.approx(runs["single"], rel=1e-5)
    (whole,) = held["single"]
    assert len(held["pp2"]) == 2 and sum(held["pp2"]) == pytest.approx(whole, abs=0.2)  # 0.1 MiB rounding
    assert len(held["ep2"]) == 2 and max(held["ep2"]) < whole


def _checkpoint_worker(rank: int, init_file: str, step: str) -> None:
    """Our checkpoint as the source: each rank's DCP read gives its stage's tensors / its experts."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        weights = StartingWeights.open(step)
        full = weights.whole_model().state_dict()
        for layout in ("pp", "ep"):
            with torch.device("meta"):
                model = build_model(weights.config)
            if layout == "pp":
                prune_to_stages(model, split_layers(weights.config, 2), [rank])
            else:
                apply_expert_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
            weights.load(model, "cpu")
            for name, tensor in model.state_dict().items():
                local, offsets = local_target(tensor)
                if layout == "ep" and "feed_forward.experts.w" in name:  # half the routed experts
                    assert local.shape[0] * 2 == full[name].shape[0], name
                region = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
                assert torch.equal(local, full[name][region]), (layout, rank, name)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_our_checkpoint_is_read_per_rank(hf_runs: Path, tmp_path: Path) -> None:
    step = hf_runs / "single" / "checkpoints" / "step-1"
    spawn(_checkpoint_worker, args=(str(tmp_path / "init"), str(step)), nprocs=2)
