"""The post-training recipes end to end, one process and several (real Lightning, Hydra, gloo):
SFT -> DPO and SFT -> GRPO as in DeepSeek-R1, each from the SFT run's checkpoint.

Layout parity: the same step computed by one process and by a layout that splits the model gives
the same numbers (bit-for-bit metrics are not expected: reductions run in another order).

- SFT with packed rows (per-document positions and attention) on 2 data-parallel replicas of a
  2-stage 1F1B pipeline (replicas hold different numbers of targets: the loss is still the mean
  over the global batch's targets);
- DPO with a frozen reference model under the pipeline (the reference runs on the last stage);
- GRPO with mu=2 and a KL reference: tensor parallel for two steps, then resumed from that
  checkpoint as a 2-stage pipeline; each rollout is sampled from the policy's shards (tp) or through
  its stages (pp), with the reference sharded alike, so the rewards (the same samples) and the
  update match the one-process run step for step;
- distillation on two processes: the teacher's samples (Lightning's predict loop, prompt batches
  split over the processes) are exactly those one process draws, then the student trains.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from dsl_lit.config.posttrain import PostTrainConfig
from dsl_lit.posttrain.chat.tokenizer import ChatTokenizer
from dsl_lit.posttrain.rejection.data import rejection_sample
from dsl_lit.tasks import arithmetic
from dsl_lit.training.pretrained import load_pretrained
from tests.conftest import ROOT, scratch_dir
from tests.forked_python import run_python

SFT_STEPS = 30
COMMON = ["trainer.progress_bar=false", "trainer.log_every_n_steps=1", "checkpoint.every_minutes=0", "logger=csv",
          "task.num_problems=200"]
SFT = ["data.seq_len=128", "data.global_batch_size=8", "data.micro_batch_size=2", f"schedule.total_steps={SFT_STEPS}"]
DPO = ["dpo.reference=model", "dpo.num_pairs=64", "data.global_batch_size=16", "data.micro_batch_size=4",
       "optim.lr=2e-3", "schedule.total_steps=8"]
GRPO = ["task=arithmetic", "data.global_batch_size=4", "data.micro_batch_size=2", "grpo.group_size=4", "grpo.sampling.max_new_tokens=16",
        "grpo.iterations=2", "grpo.eval_every_n_steps=0", "checkpoint.every_n_steps=2"]
DAPO = ["grpo=dapo", "task=arithmetic", "data.global_batch_size=2", "data.micro_batch_size=2", "grpo.group_size=4",
        "grpo.sampling.max_new_tokens=16", "grpo.dynamic_sampling.max_draws=2", "grpo.eval_every_n_steps=0",
        "task.eval_problems=8", "checkpoint.every_n_steps=0"]
PIPELINE = ["trainer.devices=2", "parallel=pp_1f1b"]
DISTILL = ["rejection.num_prompts=32", "rejection.batch_prompts=8", "rejection.min_reward=0.5",
           "rejection.keep_per_prompt=4", "data.global_batch_size=4", "data.micro_batch_size=2", "trainer.max_steps=3",
           "checkpoint.every_n_steps=0"]


def run(recipe: str, run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> None:
    result = run_python(
        [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), f"hydra.run.dir={run_dir}", *COMMON, *overrides],
        cwd=ROOT, timeout=600, env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-3000:]


def rows(run_dir: Path, key: str = "train/loss") -> dict[int, dict[str, float]]:
    """Every logged value of the steps that logged ``key``, by step."""
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): {k: float(v) for k, v in r.items() if v and k != "step"}
                for r in csv.DictReader(f) if r.get(key)}


def assert_same_steps(actual: dict, expected: dict, keys: list[str], rel: float, abs_: float = 1e-6) -> None:
    assert sorted(actual) == sorted(expected)
    for step in expected:
        for key in keys:
            assert actual[step][key] == pytest.approx(expected[step][key], rel=rel, abs=abs_), (step, key)


@pytest.fixture(scope="module")
def sft_run(request: pytest.FixtureRequest) -> Path:
    """The shared starting point: 30 SFT steps of a 2-layer DeepSeek LLM on the arithmetic task's
    R1-format replies (enough that sampled replies sometimes earn a reward)."""
    run_dir = scratch_dir(request, "posttrain") / "sft"
    run("sft", run_dir, *SFT, f"trainer.max_steps={SFT_STEPS}", f"checkpoint.every_n_steps={SFT_STEPS}")
    return run_dir


@pytest.mark.slow
def test_sft_recipe_and_packed_pipeline_parity(sft_run, tmp_path):
    loss = {step: r["train/loss"] for step, r in rows(sft_run).items()}
    assert sorted(loss) == list(range(SFT_STEPS))
    assert loss[SFT_STEPS - 1] < loss[0] - 5.0  # measured: 9.03 -> 1.53
    assert (sft_run / "checkpoints" / f"step-{SFT_STEPS}" / "meta.json").is_file()
    # held-out greedy accuracy on the task, logged at the start and the end as GRPO logs it (its
    # 64 held-out sums are unseen facts: a random model answers none, measured 0 -> 0-2%)
    accuracy = {step: r["eval/accuracy"] for step, r in rows(sft_run, "eval/accuracy").items()}
    assert sorted(accuracy) == [0, SFT_STEPS] and accuracy[0] == 0.0 and 0.0 <= accuracy[SFT_STEPS] <= 1.0
    # the first 3 steps again on dp=2 x pp=2 (same lr schedule)
    piped = tmp_path / "sft_dp2_pp2"
    run("sft", piped, *SFT, "trainer.max_steps=3", "checkpoint.every_n_steps=0", "trainer.devices=4", "parallel=pp_1f1b")
    expected = {step: r for step, r in rows(sft_run).items() if step < 3}
    assert_same_steps(rows(piped), expected, ["train/loss", "train/grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_dpo_recipe_and_pipeline_parity(sft_run, tmp_path):
    single, piped = tmp_path / "dpo", tmp_path / "dpo_pp2"
    run("dpo", single, f"init_from={sft_run}", *DPO, "trainer.max_steps=8", "checkpoint.every_n_steps=0")
    steps = rows(single)
    loss = [steps[s]["train/loss"] for s in sorted(steps)]
    margin = [steps[s]["train/rewards/margin"] for s in sorted(steps)]
    assert len(loss) == 8 and loss[0] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at step 0
    assert sum(loss[-3:]) / 3 < loss[0] - 0.1
    assert sum(margin[-3:]) / 3 > margin[0] + 0.5
    resolved = (single / "resolved_config.yaml").read_text()
    assert f"init_from: {sft_run}" in resolved and "n_layers: 2" in resolved  # the SFT run's architecture
    # pipeline: the frozen reference scores each micro-batch on the last stage
    run("dpo", piped, f"init_from={sft_run}", *DPO, "trainer.max_steps=3", "checkpoint.every_n_steps=0", *PIPELINE)
    expected = {s: r for s, r in steps.items() if s < 3}
    assert_same_steps(rows(piped), expected, ["train/loss", "train/rewards/margin", "train/grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_grpo_recipe_under_tensor_then_pipeline_parallel_with_resume(sft_run, tmp_path):
    single, sharded = tmp_path / "grpo", tmp_path / "grpo_sharded"
    run("grpo", single, f"init_from={sft_run}", *GRPO, "trainer.max_steps=4")
    expected = rows(single)
    assert len(expected) == 2  # two rollouts, two optimizer steps (mu) each
    first = expected[min(expected)]
    # rewards spread within a group in some rollout (a 20-step SFT model may score one group alike:
    # since the bundled data is decontaminated its tokenizer differs, and the first rollout's did)
    assert max(r["reward/std"] for r in expected.values()) > 0
    assert first["train/kl"] >= 0 and 0 < first["completion/length"] <= 16
    # pass@G: a group is solved when any of its completions is right, so it bounds the mean accuracy
    assert all(r["reward/accuracy"] <= r["reward/accuracy_pass_at_group"] <= 1 for r in expected.values())
    # held-out greedy accuracy at the start and the end (grpo.eval_every_n_steps=0), on those rows only
    assert sorted(rows(single, "eval/accuracy")) == [0, 4]
    assert any(r["train/kl"] > 0 for r in expected.values())  # the policy moved away from the reference
    # tensor parallel for the first rollout (mu=2 steps), checkpoint at step 2; then the same run dir
    # resumes as a 2-stage pipeline for the second rollout
    run("grpo", sharded, f"init_from={sft_run}", *GRPO, "trainer.max_steps=2", "trainer.devices=2", "parallel.tp=2")
    assert (sharded / "checkpoints" / "step-2" / "meta.json").is_file()
    # under tp the ranks sample from the policy's shards and the KL reference is sharded with it
    # (the same samples as one process: the rewards below)
    logged = (sharded / "grpo.log").read_text()
    assert "grpo: sampling from the policy's shards, in lockstep" in logged and "reference sharded like the policy" in logged
    # under the pipeline each rank samples through its stage and holds its stage of the reference
    run("grpo", sharded, f"init_from={sft_run}", *GRPO, "trainer.max_steps=4", *PIPELINE)
    logged = (sharded / "grpo.log").read_text().split("grpo: sampling from the policy's shards")[-1]
    assert "grpo: sampling from the policy's pipeline stages" in logged and "reference sharded like the policy" in logged
    keys = ["reward/mean", "reward/std", "completion/length", "train/loss", "train/kl", "train/grad_norm",
            "train/clip_fraction"]
    assert_same_steps(rows(sharded), expected, keys, rel=2e-3, abs_=1e-5)


@pytest.mark.slow
def test_grpo_dapo_preset(sft_run, tmp_path):
    """recipes/grpo.py grpo=dapo from the SFT run: no reference model (no KL), each step's batch of
    2 groups refilled by dynamic sampling (at most 2 draws), the soft length penalty and the masked
    truncated completions logged."""
    run_dir = tmp_path / "dapo"
    run("grpo", run_dir, f"init_from={sft_run}", *DAPO, "trainer.max_steps=2")
    steps = rows(run_dir, "grpo/draws")
    assert sorted(steps) == [0, 1]
    for r in steps.values():
        kept = 2 * r["grpo/draws"] - r["grpo/dropped_groups"]  # informative groups sampled
        assert r["grpo/draws"] in (1, 2)  # 2: grpo.dynamic_sampling.max_draws
        # a full batch of informative groups, or the cap reached and dropped groups filling the rest
        assert (r["grpo/filled_groups"] == 0 and kept >= 2) or (r["grpo/draws"] == 2 and r["grpo/filled_groups"] == 2 - kept)
        assert -1 <= r["reward/overlong"] <= 0 and 0 <= r["grpo/masked_completions"] <= 8
        assert "train/kl" not in r and "train/loss" in r
    assert sum(r["grpo/dropped_groups"] for r in steps.values()) > 0  # few sampled replies earn the format reward yet
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["grpo"]
    assert (resolved["loss_type"], resolved["eps_high"], resolved["beta"]) == ("dapo", 0.28, 0.0)


@pytest.mark.slow
def test_distill_samples_on_two_processes_what_one_draws(sft_run, tmp_path):
    run_dir = tmp_path / "distill"
    run("distill", run_dir, f"teacher_from={sft_run}", *DISTILL, "trainer.devices=2")
    raw = yaml.safe_load((run_dir / "teacher" / "resolved_config.yaml").read_text())
    post = PostTrainConfig.from_raw(raw)
    teacher, _ = load_pretrained(sft_run)
    train, _ = arithmetic.split(post.task)
    expected, stats = rejection_sample(teacher.eval(), ChatTokenizer.from_dir(post.tokenizer_dir),
                                       train[: post.rejection.num_prompts], arithmetic.prompt, post.rejection,
                                       seed=raw["trainer"]["seed"])
    written = [json.loads(line) for line in (run_dir / "distill_data.jsonl").read_text().splitlines()]
    assert stats.kept > 0 and written == expected
    assert json.loads((run_dir / "rejection_stats.json").read_text())["samples"] == 32 * post.rejection.samples_per_prompt
    student = rows(run_dir)
    assert sorted(student) == [0, 1, 2] and student[2]["train/loss"] < student[0]["train/loss"]
    assert "n_layers: 1" in (run_dir / "resolved_config.yaml").read_text()  # the student's architecture


@pytest.mark.slow
def test_distill_from_given_samples_samples_nothing_and_refuses_bad_ones(sft_run, tmp_path):
    """teacher_samples=<recipes/rejection_sample.py's samples.jsonl>: the student learns from that
    file and no teacher is sampled (the reproduction's distill stage reads its rejection-sampling
    stage's samples, as R1 distils from its second SFT's data); a missing or empty file, or a teacher
    named as well, is refused in one line before anything runs (exit 2)."""
    train, _ = arithmetic.split(PostTrainConfig.from_raw(
        yaml.safe_load((sft_run / "resolved_config.yaml").read_text())).task)
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"messages": [*arithmetic.prompt(p), {"role": "assistant", "content": arithmetic.reply(p)}],
                                           "reward": 1.0, "answer": p["answer"]}) + "\n" for p in train[:24]))
    run_dir = tmp_path / "student"
    run("distill", run_dir, f"teacher_samples={samples}", "data.global_batch_size=4", "data.micro_batch_size=2",
        "trainer.max_steps=3", "checkpoint.every_n_steps=0")
    assert not (run_dir / "teacher").exists() and not (run_dir / "distill_data.jsonl").exists()
    assert not (run_dir / "rejection_stats.json").exists()
    assert "in 24 conversations" in "".join(p.read_text() for p in run_dir.glob("*.log"))
    student = rows(run_dir)
    assert sorted(student) == [0, 1, 2] and student[2]["train/loss"] < student[0]["train/loss"]
    (tmp_path / "empty.jsonl").write_text("")
    for bad, names in ([f"teacher_samples={tmp_path / 'none.jsonl'}"], "teacher_samples="), \
            ([f"teacher_samples={tmp_path / 'empty.jsonl'}"], "empty.jsonl holds no conversation"), \
            ([f"teacher_samples={samples}", f"teacher_from={sft_run}"], "give one"):
        result = run_python([sys.executable, str(ROOT / "recipes" / "distill.py"), f"hydra.run.dir={tmp_path / 'refused'}",
                             *COMMON, *bad], cwd=ROOT, timeout=300)
        assert result.returncode == 2, result.stderr[-2000:]
        assert names in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "refused" / "checkpoints").exists()


@pytest.mark.slow
def test_rejection_sample_recipe_from_a_hugging_face_directory(sft_run, tmp_path):
    """recipes/rejection_sample.py with init_from=<an HF export of the SFT run>: the samples it
    keeps are exactly what the library draws from the same weights."""
    from dsl_lit.checkpoint.export_hf import export

    hf_dir = export(sft_run, tmp_path / "hf")
    run_dir = tmp_path / "rejection"
    run("rejection_sample", run_dir, f"init_from={hf_dir}", "rejection.num_prompts=16", "rejection.batch_prompts=8",
        "rejection.min_reward=0.5", "rejection.keep_per_prompt=2")
    raw = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    post = PostTrainConfig.from_raw(raw)
    teacher, _ = load_pretrained(hf_dir)
    train, _ = arithmetic.split(post.task)
    expected, stats = rejection_sample(teacher.eval(), ChatTokenizer.from_dir(post.tokenizer_dir),
                                       train[: post.rejection.num_prompts], arithmetic.prompt, post.rejection,
                                       seed=raw["trainer"]["seed"])
    written = [json.loads(line) for line in (run_dir / post.rejection.output).read_text().splitlines()]
    assert written == expected and stats.kept == len(written)


@pytest.mark.slow
def test_grpo_cold_start_then_rl_from_a_random_model(tmp_path):
    """recipes/grpo.py with no init_from: R1's cold-start SFT runs first as its own run, then GRPO
    starts from its last checkpoint."""
    run_dir = tmp_path / "grpo"
    run("grpo", run_dir, "model.n_layers=1", "grpo.cold_start_steps=3", *GRPO, "trainer.max_steps=1")
    cold = run_dir / "cold_start"
    assert sorted(rows(cold)) == [0, 1, 2] and (cold / "checkpoints" / "step-3" / "meta.json").is_file()
    assert f"init_from: {cold}" in (run_dir / "resolved_config.yaml").read_text()
    # the cold start's own settings were validated and recorded with its run (before: patched after
    # validation, its resolved_config.yaml showing GRPO's max_steps and lr)
    resolved = yaml.safe_load((cold / "resolved_config.yaml").read_text())
    assert resolved["trainer"]["max_steps"] == resolved["schedule"]["total_steps"] == 3
    assert resolved["checkpoint"]["every_n_steps"] == 3 and resolved["data"]["global_batch_size"] == 8
    assert sorted(rows(run_dir)) == [0]
    # the cold start's random init comes from trainer.seed: a second run, in an interpreter whose
    # string hashes differ as they do between any two shells, is the same run (it was not seeded,
    # and the GRPO demo's cold start differed from run to run)
    again = tmp_path / "grpo_again"
    run("grpo", again, "model.n_layers=1", "grpo.cold_start_steps=3", *GRPO, "trainer.max_steps=1",
        env={"PYTHONHASHSEED": str(1 + int(os.environ.get("PYTHONHASHSEED", "0") or 0))})
    def same(a: dict, b: dict) -> bool:
        return {s: (r["train/loss"], r["train/grad_norm"]) for s, r in a.items()} == \
            {s: (r["train/loss"], r["train/grad_norm"]) for s, r in b.items()}

    assert same(rows(again / "cold_start"), rows(cold)) and same(rows(again), rows(run_dir))
