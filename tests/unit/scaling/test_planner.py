"""The cluster planner: validation, the schedules' bubble formulas, memory facts, layout search,
the recipe, and checks against reality: three published DeepSeek-V3 runs (DeepSeek's own,
Megatron-Bridge, NeMo AutoModel), Llama 3 405B, this project's measured H200 steps, and a real CPU
step's measured memory."""

from __future__ import annotations

import json
import sys

import pytest

from data_contract.errors import ConfigError
from dsl_lit.config.model import ModelConfig
from dsl_lit.flops import training_flops_per_token
from dsl_lit.scaling.planner import ClusterConfig, PlanLayout, estimate_memory, make_plan, search_layouts
from dsl_lit.scaling.planner.config import plan_inputs
from dsl_lit.scaling.planner.memory import in_flight, routed_shape
from dsl_lit.scaling.planner.published import MEASURED, PUBLISHED, compare, comparison_table
from dsl_lit.scaling.planner.report import write_plan
from dsl_lit.scaling.planner.step_time import _bubble
from tests.conftest import ROOT, compose_config

V3_GPU_HOURS_PER_T = 180_000  # DeepSeek-V3 section 1: 2664K H800 GPU-hours for 14.8T tokens
V3_TOLERANCE = 0.25
"""The planner predicts 168K (-6%): a steady state with balanced experts. DeepSeek's figure is a
whole run (batch-size ramp, checkpoints, restarts; the ramp alone costs the planner ~0.5%). Before
issue 40's calibration (memory-bound passes 4 -> 8 on our H200 step, grouped expert GEMMs at 0.8
of dense) it predicted 131K (-27%)."""


def plan_of(*overrides: str):
    return make_plan(*plan_inputs(compose_config("plan", list(overrides)))[:3])


def test_deepseek_v3_on_2048_h800_against_the_published_cost():
    plan = plan_of("plan_experiment=deepseek_v3_671b_h800")
    assert plan.layout.parallel.world_size == 2048 and plan.layout.parallel.dp == 128 and plan.layout.micro_batches == 120
    error = plan.gpu_hours_per_trillion_tokens / V3_GPU_HOURS_PER_T - 1
    assert abs(error) < V3_TOLERANCE, f"{plan.gpu_hours_per_trillion_tokens:.0f} GPU-h/T: {error:+.1%}"
    assert plan.step.ep_comm == 0  # DualPipe hides the all-to-all behind the paired chunk's compute
    assert plan.step.ep_comm_per_micro_batch > 0
    assert "DualPipe is planned only" in plan.layout.runtime_issue(plan.model)


def test_deepseek_v3_fits_in_80_gb_with_its_own_recipe():
    """The real run fit in 80 GB H800s. With its recipe (norms and MLA up-projections recomputed,
    FP8 / E5M6 cached linear inputs, SwiGLU output recomputed) the planner gives 72.1 GiB on the
    busiest rank: weights 6.1, fp32 gradients 12.2, ZeRO-1 master + bf16 moments 2.7, 17 (PP + 1)
    stage-micro-batches of activations 40.7, working set and all-to-all buffers 4.2, reserved and
    fragmentation 6.3. Our runtime's ``selective`` (GEMM outputs kept in bf16) would need 134."""
    plan = plan_of("plan_experiment=deepseek_v3_671b_h800")
    assert plan.fits and plan.memory_per_gpu_gib < 80, plan.memory.gib()
    selective = plan_of("plan_experiment=deepseek_v3_671b_h800", "plan.recompute=selective")
    assert not selective.fits and plan.memory.activations < selective.memory.activations / 2
    assert "plan.recompute=deepseek_v3 is planned only" in plan_of(
        "plan_experiment=deepseek_v3_671b_h800", "parallel.pp_schedule=DualPipeV").layout.runtime_issue(plan.model)


LLAMA3_TFLOPS = {"llama3_405b_h100": 400.0, "llama3_405b_8k_h100": 430.0}  # arXiv 2407.21783, Table 4
LLAMA3_TOLERANCE = 0.15


@pytest.mark.parametrize("preset", sorted(LLAMA3_TFLOPS))
def test_llama3_405b_throughput_against_the_published_tflops(preset):
    """Model TFLOP/s per GPU (``dsl_lit.flops``: 6 per weight and token plus unhalved attention)
    against Llama 3's Table 4, within 15%: predicted 380 on 16K GPUs (-5%) and 460 on 8K (+7%).
    The layout is the paper's; 2 virtual pipeline stages per rank are an assumption (its Figure 6),
    and its TFLOP/s may count attention FLOPs another way (halved: 4% fewer). The memory estimate
    does not hold here: it gives 107 GiB where the published run fit in 80 GB (it counts the
    activations our blocks keep with no recompute, an assumption; Meta's kernels and settings kept less)."""
    plan = plan_of(f"plan_experiment={preset}")
    assert plan.layout.parallel.tp == 8 and plan.layout.parallel.pp == 16 and plan.layout.micro_batches * plan.layout.parallel.dp == 2048
    tflops = plan.tokens_per_gpu_per_s * training_flops_per_token(plan.model, plan.layout.seq_len) / 1e12
    error = tflops / LLAMA3_TFLOPS[preset] - 1
    assert abs(error) < LLAMA3_TOLERANCE, f"{tflops:.0f} TFLOP/s per GPU: {error:+.1%}"


def test_plan_validation_names_the_field():
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_node=0 must be a positive integer"):
        plan_of("cluster.gpus_per_node=0")
    with pytest.raises(ConfigError, match=r"cluster.efficiency.gemm=1.5 must be in \(0, 1\]"):
        plan_of("cluster.efficiency.gemm=1.5")
    with pytest.raises(ConfigError, match=r"parallel.tp=3 x parallel.pp=1 = 3 does not divide the cluster's 8 GPUs"):
        plan_of("parallel.tp=3")
    with pytest.raises(ConfigError, match=r"parallel.ep=3 must divide model.n_routed_experts"):
        plan_of("plan_experiment=deepseek_v3_671b_h800", "parallel.ep=3")
    with pytest.raises(ConfigError, match=r"plan.top_k=0"):
        plan_of("plan.top_k=0")


DENSE = ModelConfig.from_name("deepseek_llm_7b")


@pytest.mark.parametrize("schedule, expected", [
    ("1F1B", 3 * (1 + 2)),  # (pp-1)(F+B)
    ("GPipe", 3 * (1 + 2)),
    ("ZB1P", 3 * (1 + 2 - 2 * 1)),  # (pp-1)(F+B-2W)
    ("DualPipe", (4 / 2 - 1) * (1 + 2 + 2 - 3 * 1)),  # (PP/2-1)(F&B+B-3W), F&B = F+B
    ("DualPipeV", (8 / 2 - 1) * (1 + 2 + 2 - 3 * 1)),  # the same over its 2 pp stages
])
def test_bubble_formulas_of_design_md(schedule, expected):
    layout = PlanLayout.of(pp=4, pp_schedule=schedule, global_batch_size=16)
    assert _bubble(layout, f=1.0, b=2.0, w=1.0) == pytest.approx(expected)


def test_memory_facts():
    base = PlanLayout.of(dp=8, global_batch_size=64, seq_len=4096, precision="bf16", zero1=False)
    plain = estimate_memory(DENSE, base)
    zero = estimate_memory(DENSE, base.replace(zero1=True))
    assert zero.optimizer == pytest.approx(plain.optimizer / 8)  # master + moments sharded over dp
    assert plain.optimizer == pytest.approx(12 * plain.params_on_gpu)  # fp32 master 4 + moments 8
    assert plain.weights == pytest.approx(2 * plain.params_on_gpu) and plain.gradients == pytest.approx(4 * plain.params_on_gpu)
    muon = estimate_memory(DENSE, base.replace(optimizer="muon"))
    assert muon.optimizer == pytest.approx(8 * plain.params_on_gpu)  # fp32 master 4 + Muon's momentum 4
    acts = {mode: estimate_memory(DENSE, base.replace(recompute=mode)).activations
            for mode in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"]
    pipe = base.replace(dp=2, pp=4, global_batch_size=32)
    assert [in_flight(r, pipe) for r in range(4)] == [4, 3, 2, 1]  # 1F1B warm-up depth
    dual = estimate_memory(DENSE, pipe.replace(pp_schedule="DualPipe"))
    assert dual.params_on_gpu == pytest.approx(2 * DENSE_PARAMS / 4, rel=0.15)  # two stages per rank


DENSE_PARAMS = 6.9e9


def test_search_finds_layouts_that_fit_fastest_first():
    cluster = ClusterConfig(name="test", nodes=1).validate()
    base = PlanLayout.of(global_batch_size=64, seq_len=4096, precision="bf16", zero1=True)
    plans = search_layouts(DENSE, base, cluster, micro_batch_sizes=(1,), max_pp=4)
    assert plans and all(p.fits for p in plans)
    assert [p.step.total for p in plans] == sorted(p.step.total for p in plans)
    assert plans[0].layout.parallel.world_size == 8


def test_memory_estimate_matches_a_real_cpu_step():
    """Peak resident memory of real PretrainModule steps (fp32, CPU) vs the estimate. The estimate
    counts tensors; the process also holds what the allocator and the BLAS library keep as
    transient workspace, which depends on the CPU: the same code measured 236 MiB estimated against
    ~295 MiB on an AMD EPYC and 315 MiB on an Intel Xeon with AMX (2026-11-27, the session's starting
    commit too). So the estimate may run low by up to 30% (that workspace), never high by over 5%."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.planner_memory import estimate, measure

    case = ("deepseek_llm_tiny", 8, 4, 256, "none")  # two micro-batches: gradients exist during backward
    est, meas = estimate(*case), measure(*case, steps=2)
    assert 0.70 * meas <= est <= 1.05 * meas, f"estimated {est / 2**20:.0f} MiB, measured {meas / 2**20:.0f} MiB"


def test_plan_recipe_writes_plan_json_and_searches(tmp_path, capsys):
    """What recipes/plan.py runs (``write_plan``), in process: ``recipes/plan.py`` only adds @hydra.main."""
    cfg = compose_config("plan", ["plan_experiment=deepseek_llm_7b", "cluster.nodes=1", "plan.global_batch_size=64",
                                  "plan.search=true", "plan.top_k=3"])
    write_plan(cfg, tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    for key in ("memory_per_gpu_gib", "step_time_s", "tokens_per_gpu_per_s", "mfu", "gpu_hours_per_trillion_tokens"):
        assert plan[key] > 0
    assert "GPU-hours / 1T tokens" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "search.json").read_text())) == 3


def compose_plan(overrides: list[str]):
    return compose_config("plan", overrides)


@pytest.mark.parametrize("reference", PUBLISHED, ids=lambda r: r.name)
def test_published_deepseek_v3_runs_within_25_percent(reference):
    """Each of the three published DeepSeek-V3 runs, planned with its own layout by the same model
    and constants: DeepSeek's 180K H800 GPU-hours per trillion tokens (predicted 168K, -6%),
    Megatron-Bridge's 1,297 tokens/s/GPU on 1024 H100 (1,346, +4%), NeMo AutoModel's 1,002 on 256
    H100 (1,077, +7%)."""
    (comparison,) = compare(compose_plan, [reference])
    assert comparison.within and abs(comparison.error) < 0.25, comparison_table([comparison])
    assert comparison.plan.model.name.startswith("deepseek_v3_671b")


def test_published_layouts_are_the_published_ones():
    deepseek, megatron, automodel = (c.plan for c in compare(compose_plan, PUBLISHED))
    assert (deepseek.layout.parallel.world_size, deepseek.cluster.gpu, deepseek.layout.precision) == (2048, "H800", "fp8")
    par = megatron.layout.parallel
    assert (par.world_size, par.tp, par.pp, par.pp_virtual_stages, par.ep, par.dp) == (1024, 2, 8, 4, 64, 64)
    assert (megatron.cluster.gpu, megatron.layout.precision, megatron.layout.global_batch_size) == ("H100", "fp8", 8192)
    assert megatron.layout.overlaps_all_to_all and megatron.step.ep_comm == 0 and megatron.step.pp_comm == 0
    par = automodel.layout.parallel
    assert (par.world_size, par.tp, par.pp, par.pp_virtual_stages, par.ep, par.dp) == (256, 1, 4, 8, 64, 64)
    assert (automodel.layout.precision, automodel.layout.recompute, automodel.model.mtp_modules) == ("bf16", "full", 0)
    assert not automodel.layout.overlaps_all_to_all and automodel.step.ep_comm > 0  # DeepEP waited for


@pytest.mark.parametrize("reference", MEASURED, ids=lambda r: r.name)
def test_single_gpu_steps_against_our_h200_measurements(reference):
    """Issue 40's GPU check on one H200 (4 x 2048 tokens, forward + backward + AdamW, compiled):
    dense ~1B bf16 99.4 ms (predicted 96.2, -3%) and FP8 88.7 ms (81.0, -9%) within 25%; the
    V3-style MoE 49.2 ms against 31.1 predicted (-37%): our MoE step still has fixed costs the
    planner does not model (issue 40, item 4), so its band says only that the planner is faster,
    by less than 2x."""
    (comparison,) = compare(compose_plan, [reference])
    assert comparison.within, comparison_table([comparison])
    assert comparison.plan.layout.parallel.world_size == 1 and comparison.plan.cluster.gpu == "H200"


def test_calibration_moves_the_published_runs_the_way_it_should():
    """The knobs act where they should: fewer memory-bound passes or dense-speed grouped GEMMs make
    every run faster (the pre-calibration constants put DeepSeek's own at -27%); FP8 at the bf16
    rate slows only the FP8 runs."""
    base = {c.reference.name: c.plan.step.total for c in compare(compose_plan, PUBLISHED)}
    for knob in ("cluster.efficiency.activation_passes=4", "cluster.efficiency.grouped_gemm=1.0"):
        faster = {c.reference.name: c.plan.step.total for c in compare(compose_plan, PUBLISHED, extra=[knob])}
        assert all(faster[name] < base[name] for name in base), knob
    old = compare(compose_plan, PUBLISHED[:1], extra=["cluster.efficiency.activation_passes=4",
                                                      "cluster.efficiency.grouped_gemm=1.0"])[0]
    assert old.error == pytest.approx(-0.27, abs=0.01)
    slow_fp8 = {c.reference.name: c.plan.step.total
                for c in compare(compose_plan, PUBLISHED, extra=["cluster.efficiency.fp8_gemm=0.375"])}
    assert [slow_fp8[r.name] > base[r.name] for r in PUBLISHED] == [True, True, False]


def test_all_to_all_overlap_and_routed_nodes():
    """``plan.ep_overlap`` hides the all-to-all of a 1F1B schedule under the paired micro-batch (at
    the SMs it takes) and is planned only there; ``plan.routed_nodes`` sets the nodes a token's
    copies reach over InfiniBand; tp ranks split the routed tokens under expert parallelism."""
    megatron = "plan_experiment=deepseek_v3_671b_megatron_h100"
    hidden, waiting = plan_of(megatron), plan_of(megatron, "plan.ep_overlap=false")
    assert hidden.step.ep_comm == 0 < waiting.step.ep_comm
    assert waiting.step.ep_comm == pytest.approx(waiting.layout.micro_batches * waiting.step.ep_comm_per_micro_batch)
    assert hidden.step.forward_per_micro_batch > waiting.step.forward_per_micro_batch  # comm SMs taken
    issue = hidden.layout.replace(recompute="selective").runtime_issue(hidden.model)
    assert "plan.ep_overlap=true under Interleaved1F1B is planned only" in issue
    automodel = "plan_experiment=deepseek_v3_671b_automodel_h100"
    one, limited = plan_of(automodel), plan_of(automodel, "plan.routed_nodes=null")
    # node-limited routing: 4 of the 8 nodes per token over InfiniBand; one node: NVLink-bound, 3.5x less
    assert limited.step.ep_comm_per_micro_batch == pytest.approx(3.5 * one.step.ep_comm_per_micro_batch, rel=0.01)
    with pytest.raises(ConfigError, match=r"plan.routed_nodes=0 must be null or a positive integer"):
        plan_of(automodel, "plan.routed_nodes=0")
    assert routed_shape(hidden.model, hidden.layout) == (4.0, 2048.0)  # 8 copies over tp 2, whole experts
    assert routed_shape(hidden.model, hidden.layout.replace(ep=1)) == (8.0, 1024.0)  # tp-sharded experts


def test_plan_recipe_compares_with_the_published_runs(tmp_path, capsys):
    """``plan.published=true``: the table of every reference run, and published.json; the command
    line's efficiencies apply to every run."""
    cfg = compose_config("plan", ["plan_experiment=deepseek_llm_7b", "plan.published=true"])
    write_plan(cfg, tmp_path, overrides=["plan.published=true", "cluster.efficiency.grouped_gemm=1.0"],
               compose=compose_plan)
    rows = json.loads((tmp_path / "published.json").read_text())
    assert [r["name"] for r in rows] == [r.name for r in (*PUBLISHED, *MEASURED)]
    assert rows[0]["published"] == V3_GPU_HOURS_PER_T and rows[0]["gpus"] == 2048
    out = capsys.readouterr().out
    assert "with cluster.efficiency.grouped_gemm=1.0" in out and "Megatron-Bridge" in out
    assert rows[0]["predicted"] < 0.95 * compare(compose_plan, PUBLISHED[:1])[0].predicted  # the knob applied
