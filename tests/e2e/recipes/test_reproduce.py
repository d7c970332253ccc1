"""`make reproduce` (recipes/reproduce.py): every stage of the method feeds the next, a run killed
mid-GRPO resumes to the same numbers, subsets and changed settings are refused early, and the
report's claims are judged by their written thresholds."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose

from data_contract.errors import ConfigError
from dsl_lit.config.reproduce import STAGES, ReproduceConfig
from dsl_lit.reproduce.claims import INCONCLUSIVE, NOT_MEASURED, NOT_REPRODUCED, REPRODUCED, claims_table
from dsl_lit.reproduce.runner import MARKER, selected
from dsl_lit.reproduce.stages import CONTEXT_BASE_STOP_AT, EVALUATED, STAGE_TABLE, pretraining_hparams
from tests.conftest import scratch_dir
from tests.forked_python import run_python, start_python

ROOT = Path(__file__).resolve().parents[3]
RECIPE = [sys.executable, str(ROOT / "recipes" / "reproduce.py"), "reproduce=smoke"]
ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def reproduce(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The runner forked from the tests' zygote (torch and Lightning imported there once), as its
    stages are forked from it: the same process as ``python recipes/reproduce.py``."""
    return run_python([*RECIPE, f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT, env=ENV, timeout=900)


def metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): {k: float(v) for k, v in r.items() if v and k not in ("step", "epoch")}
                for r in csv.DictReader(f) if r.get("train/loss")}


def val_steps(run_dir: Path) -> list[int]:
    """The steps a run validated at (its CSV's val/loss rows, logged at the step's index)."""
    with (run_dir / "metrics.csv").open() as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("val/loss")]


@pytest.fixture(scope="module")
def interrupted_run(request: pytest.FixtureRequest) -> tuple[Path, str]:
    """The smoke chain, stopped by SIGTERM once GRPO has saved its first checkpoint, then rerun."""
    run_dir = scratch_dir(request, "reproduce") / "smoke"
    first_checkpoint = run_dir / "grpo" / "checkpoints" / "step-2" / "meta.json"
    child = start_python([*RECIPE, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=ENV, stdout=run_dir.parent / "first.log")
    deadline = time.monotonic() + 900
    while not first_checkpoint.is_file() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    child.send_signal(signal.SIGTERM)
    code = child.wait(timeout=300)
    first = (run_dir.parent / "first.log").read_text()
    assert code == 143, first[-3000:]  # stopped, not failed
    assert not (run_dir / "grpo" / MARKER).exists() and (run_dir / "cold_start" / MARKER).is_file()
    rerun = reproduce(run_dir)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    return run_dir, rerun.stdout + rerun.stderr


@pytest.mark.slow
def test_every_stage_feeds_the_next_and_the_report_has_every_section(interrupted_run):
    run_dir, log = interrupted_run
    n = len(STAGES)
    for index, stage in enumerate(STAGES[:STAGES.index("grpo")], 1):  # finished before the stop: skipped
        assert f"stage {index}/{n} {stage}: finished earlier" in log
    assert f"stage {STAGES.index('grpo') + 1}/{n} grpo: GRPO" in log and "about" in log and "elapsed" in log
    assert "resuming from" in (run_dir / "grpo" / "stage.log").read_text()
    done = {s: json.loads((run_dir / s / MARKER).read_text()) for s in STAGES}

    def resolved(stage: str) -> dict:
        return yaml.safe_load((run_dir / stage / "resolved_config.yaml").read_text())

    # checkpoints chain through init_from (and teacher_from); the data stage's shards and tokenizer everywhere
    assert resolved("yarn")["init_from"] == str(run_dir / "context_base")
    assert resolved("cold_start")["init_from"] == str(run_dir / "pretrain")
    assert resolved("grpo")["init_from"] == str(run_dir / "cold_start")
    assert resolved("sft_rs")["init_from"] == str(run_dir / "pretrain")
    assert resolved("sft_rs")["sft"]["dataset"] == str(run_dir / "rejection_sample" / "samples.jsonl")
    assert f"teacher_samples='{run_dir / 'rejection_sample' / 'samples.jsonl'}'" in done["distill"]["commands"][0]
    assert resolved("sft_rs")["sft"]["packing"] is not False  # packed, as the cold start's replies
    ablation = {name: [f"ablations/{name}/seed{k}" for k in range(2)] for name in ("baseline", "no_mtp", "no_bias")}
    for stage in ("pretrain", *ablation["baseline"], *ablation["no_mtp"], *ablation["no_bias"]):
        assert resolved(stage)["data"]["cache_dir"] == str(run_dir / "data" / "pipeline")
    assert all(resolved(stage)["data"]["corpus_dir"].endswith("data/passkey/short" if stage == "context_base" else
                                                              "data/passkey/medium") for stage in ("context_base", "yarn"))
    # the fitted lr and batch (with its ramp) are what pretraining ran with
    hp = done["scaling"]["results"]
    pre = resolved("pretrain")
    assert pre["optim"]["lr"] == hp["lr"] and pre["data"]["global_batch_size"] == hp["global_batch_size"] == 8
    for stage in ("pretrain", "context_base", "yarn"):  # the steps each trained (not its last 0-based index)
        assert done[stage]["results"]["steps"] == resolved(stage)["trainer"]["max_steps"], stage
    # the pretraining's last validation, and after which step it ran (the report names it beside the loss)
    assert done["pretrain"]["results"]["val_step"] == max(val_steps(run_dir / "pretrain")) + 1
    assert done["pretrain"]["results"]["val_step"] % resolved("pretrain")["trainer"]["val_every_n_steps"] == 0
    assert pre["data"]["batch_ramp"] == {"start": 4, "tokens": hp["ramp_tokens"], "increment": 4}
    ramp = {int(s): r["train/global_batch_size"] for s, r in metrics(run_dir / "pretrain").items()}
    assert ramp[min(ramp)] == 4 and ramp[max(ramp)] == 8
    # the ablations differ from each other in their one setting and their seed only, over half the steps
    runs = done["ablations"]["results"]["variants"]
    assert done["ablations"]["results"]["steps"] == round(hp["max_steps"] / 2)
    for name, dirs in ablation.items():
        assert [resolved(d)["trainer"]["seed"] for d in dirs] == [1234, 1235], name
        assert [resolved(d)["trainer"]["max_steps"] for d in dirs] == [done["ablations"]["results"]["steps"]] * 2
        # validated once, after the last step (every 4 steps before: the last one mid-run)
        assert [resolved(d)["trainer"]["val_every_n_steps"] for d in dirs] == [done["ablations"]["results"]["steps"]] * 2
        assert [val_steps(run_dir / d) for d in dirs] == [[done["ablations"]["results"]["steps"] - 1]] * 2
    assert {resolved(d)["model"]["mtp_depth"] for d in ablation["no_mtp"]} == {0}
    # V3's init std scaled to the tiny width, the pretraining's and every ablation run's
    assert {resolved(d)["model"]["init_std"] for dirs in ablation.values() for d in dirs} == {pre["model"]["init_std"]} == {0.0317}
    assert all(r["mtp_loss"] > 0 for r in runs["baseline"]) and all(r["mtp_loss"] is None for r in runs["no_mtp"])
    assert {tuple(resolved(d)["objective"]["bias_update_rate"]) for d in ablation["no_bias"]} == {(0.0, 0.0)}
    assert runs["baseline"][0]["val_loss"] != runs["baseline"][1]["val_loss"]  # another seed, another run
    assert resolved("context_base")["data"]["seq_len"] == 128 and resolved("context_base")["model"]["rope_scaling"] is None
    assert resolved("yarn")["model"]["rope_scaling"]["factor"] == 4 and resolved("yarn")["data"]["seq_len"] == 512
    # the base probed retrieval while training (every 2 steps in the smoke preset), to stop at CONTEXT_BASE_STOP_AT
    probe = resolved("context_base")["eval"]["passkey"]
    assert (probe["every_n_steps"], probe["stop_at"], probe["length"]) == (2, CONTEXT_BASE_STOP_AT, 128)
    assert [step for step, _ in done["context_base"]["results"]["probe"]] == [2, 4]  # 4 steps retrieve (next to) nothing
    assert all(share < CONTEXT_BASE_STOP_AT for _, share in done["context_base"]["results"]["probe"])
    key = done["passkey"]["results"]
    assert set(key["accuracy"]) == set(key["retrieved"]) == {"context_base", "yarn"}
    assert key["trained_length"] == {"context_base": 128, "yarn": 512}
    for model in ("context_base", "yarn"):  # prompt by prompt (one depth, one prompt each: the smoke preset)
        assert {n: sum(hits) / len(hits) for n, hits in key["retrieved"][model].items()} == key["accuracy"][model]
    for stage in ("cold_start", "grpo", "sft_rs", "distill"):  # each R1 stage's held-out outcomes, problem by problem
        outcomes = done[stage]["results"]["held_out_outcomes"]
        assert len(outcomes) == 8 and sum(outcomes) / 8 == done[stage]["results"]["eval_accuracy"], stage
    assert set(done["evaluate"]["results"]["scores"]) == set(EVALUATED)
    for model in EVALUATED:
        assert "acc" in done["evaluate"]["results"]["scores"][model]["dsl_kjv_next_sentence"]
    # one report, its figures beside it
    report = (run_dir / "report" / "report.md").read_text()
    for heading in ("What the papers say", "1. Scaling laws", "2. Data pipeline", "3. Pretraining",
                    "4. Context extension", "5. The R1 pipeline", "6. lm-eval"):
        assert heading in report
    assert re.search(r"The base's probe retrieved \d+% at step 4 \(the cap, below its stop at 70%", report)
    for png in ("pretrain_loss.png", "expert_load.png", "batch_ramp.png", "passkey.png", "context_base_probe.png", "grpo.png",
                "r1_accuracy.png", "scaling_hparam_landscape.png"):
        assert f"]({png})" in report and (run_dir / "report" / png).stat().st_size > 5000
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in report.split("## 1.")[0].splitlines()
                if line.startswith("| ") and "DeepSeek" in line]
    assert len(verdicts) == 9 and set(verdicts) <= {REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE}
    assert "Ablations: 2 seeds (1234, 1235) per variant" in report


@pytest.mark.slow
def test_a_run_killed_mid_grpo_ends_with_the_numbers_of_one_never_stopped(interrupted_run):
    run_dir, _ = interrupted_run
    resumed = run_dir / "grpo"
    # a copy of the run without GRPO: it runs again there, never stopped
    fresh = run_dir.parent / "grpo_never_stopped"
    shutil.copytree(run_dir, fresh, ignore=lambda d, names: ["grpo"] if Path(d) == run_dir else [])
    again = reproduce(fresh, "reproduce.stages=[grpo]")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" not in (fresh / "grpo" / "stage.log").read_text()
    expected, actual = metrics(fresh / "grpo"), metrics(resumed)
    assert sorted(actual) == sorted(expected) == [0, 1, 2, 3]
    for step, row in expected.items():
        for key in ("train/loss", "reward/mean", "train/grad_norm", "completion/length"):
            assert actual[step][key] == pytest.approx(row[key], rel=1e-5, abs=1e-7), (step, key)
    first = json.loads((resumed / MARKER).read_text())["results"]
    second = json.loads((fresh / "grpo" / MARKER).read_text())["results"]
    assert first["eval_accuracy"] is not None and first["eval_accuracy"] == second["eval_accuracy"]
    assert first["train_loss"] == pytest.approx(second["train_loss"], rel=1e-5)


def test_bad_subsets_and_changed_settings_are_refused_before_any_stage_runs(tmp_path):
    cfg = ReproduceConfig(stages=["grpo"]).validate()
    with pytest.raises(ConfigError, match="stage grpo needs data, which has not finished"):
        selected(cfg, STAGE_TABLE, tmp_path)
    with pytest.raises(ConfigError, match="unknown stage 'grop'"):
        ReproduceConfig(stages=["grop"]).validate()
    with pytest.raises(ConfigError, match="reproduce.overrides.pretrain must be a list of Hydra overrides"):
        ReproduceConfig(overrides={"pretrain": "trainer.max_steps=3"}).validate()
    # a stage finished with other settings (here: another pretraining budget) is not silently reused
    (tmp_path / "scaling").mkdir()
    (tmp_path / "scaling" / MARKER).write_text(json.dumps({"fingerprint": "0" * 16, "seconds": 1, "results": {}}))
    with pytest.raises(ConfigError, match="stage scaling finished in .* with other settings"):
        selected(ReproduceConfig().validate(), STAGE_TABLE, tmp_path)
    # a new eval_limit touches the evaluation only: the finished pretraining still stands
    from dsl_lit.reproduce.runner import fingerprints

    before, after = fingerprints(ReproduceConfig(), STAGE_TABLE), fingerprints(ReproduceConfig(eval_limit=4), STAGE_TABLE)
    assert [s for s in STAGES if before[s] != after[s]] == ["evaluate"]
    bigger = ReproduceConfig(overrides={"pretrain": ["++model.n_layers=6"]})  # another model: another batch and lr
    changed = [s for s in STAGES if fingerprints(bigger, STAGE_TABLE)[s] != before[s]]
    assert changed[:3] == ["scaling", "pretrain", "ablations"] and "data" not in changed
    seeded = ReproduceConfig(seed=7)  # another seed: every training stage again, not the data
    assert [s for s in STAGES if fingerprints(seeded, STAGE_TABLE)[s] != before[s]] == [
        s for s in STAGES if s not in ("data", "report")]
    # an interrupted stage's checkpoints were made with its settings: resuming them under others is refused
    (tmp_path / "started" / "data").mkdir(parents=True)
    (tmp_path / "started" / "data" / "STARTED.json").write_text(json.dumps({"fingerprint": "1" * 16}))
    with pytest.raises(ConfigError, match="stage data started in .* with other settings"):
        selected(ReproduceConfig().validate(), STAGE_TABLE, tmp_path / "started")
    # and the recipe says so in one line, exit 2, having run nothing
    result = reproduce(tmp_path / "run", "reproduce.stages=[grpo]")
    assert result.returncode == 2 and "stage grpo needs" in result.stderr
    assert not (tmp_path / "run" / "grpo").exists()


def test_pretraining_batch_and_lr_come_from_the_fit_unclamped_with_a_ramp_that_spends_the_tokens():
    from dsl_lit.scaling.bootstrap import LawSamples
    from dsl_lit.scaling.laws import PowerLaw

    cfg = ReproduceConfig(pretrain_tokens=400_000, seq_len=128, micro_batch_size=4).validate()
    samples = {"batch_tokens": LawSamples((PowerLaw(1.0, 0.25), PowerLaw(1.0, 0.35)), 0).to_dict(),
               "lr": LawSamples((PowerLaw(0.5, -0.2), PowerLaw(0.5, -0.1)), 0).to_dict()}
    laws = {"hparams": {"batch_tokens": {"coefficient": 1.0, "exponent": 0.3}, "lr": {"coefficient": 0.5,
                                                                                       "exponent": -0.15},
                        "bootstrap": samples}}
    hp = pretraining_hparams(laws, cfg)
    c = hp["compute_C"]
    assert hp["batch_fit_sequences"] == pytest.approx(c**0.3 / 128) and hp["lr_fit"] == pytest.approx(0.5 * c**-0.15)
    # the fit's values, the batch only rounded to whole micro-batches
    assert hp["global_batch_size"] == round(hp["batch_fit_sequences"] / 4) * 4 and hp["lr"] == hp["lr_fit"]
    assert not hp["clamped"]
    low, high = hp["batch_interval_sequences"]
    assert low < hp["batch_fit_sequences"] < high and hp["lr_interval"][0] < hp["lr"] < hp["lr_interval"][1]
    assert hp["ramp_start"] == hp["global_batch_size"] // 4 // 4 * 4 and hp["ramp_tokens"] == 100_000
    # a preset that pins them (the smoke test's few-step sweep) clamps, and says so
    pinned = pretraining_hparams(laws, ReproduceConfig(pretrain_tokens=400_000, seq_len=128, micro_batch_size=4,
                                                       batch_range=[8, 16], lr_range=[3e-4, 3e-3]).validate())
    assert pinned["global_batch_size"] == 16 and pinned["lr"] == 3e-3 and pinned["clamped"]
    # the steps spend D: one step fewer would not
    from dsl_lit.config.data import BatchRampConfig, BatchSchedule

    schedule = BatchSchedule(hp["global_batch_size"], 128, BatchRampConfig(hp["ramp_start"], hp["ramp_tokens"], 4))
    assert schedule.advance(0, hp["max_steps"]) * 128 >= 400_000 > schedule.advance(0, hp["max_steps"] - 1) * 128
    # no fitted law (a sweep of one budget): the paper's
    assert pretraining_hparams({}, cfg)["source"].startswith("paper")


def _done(results: dict) -> dict:
    return {stage: {"results": r} for stage, r in results.items()}


def test_claims_are_judged_by_their_written_thresholds():
    def laws(batch, lr, scale):  # (exponent, its bootstrap interval) of each law
        def law(name, fit):
            return {name: {"exponent": fit[0]}, "bootstrap": {name: {"exponent_interval": list(fit[1])}}, "edges": []}
        hp, alloc = law("batch_tokens", batch), law("model_scale", scale)
        hp["lr"] = {"exponent": lr[0]}
        hp["bootstrap"]["lr"] = {"exponent_interval": list(lr[1])}
        return {"scaling": {"laws": {"hparams": hp, "allocation": alloc}}}

    hparams, allocation = ("Optimal batch size grows and optimal learning rate shrinks with compute, as power laws",
                           "The compute-optimal model scale grows with compute")
    flat = laws((1e-16, (-0.1, 0.1)), (-0.3, (-0.5, -0.1)), (0.6, (0.3, 0.9)))
    table = {row[0]: (row[2], row[3]) for row in claims_table(_done(flat))}
    assert table[hparams][1] == INCONCLUSIVE and "B_opt ~ C^0 (flat" in table[hparams][0]
    assert "[-0.100, 0.100]" in table[hparams][0] and table[allocation][1] == REPRODUCED
    wrong_sign = laws((-0.3, (-0.5, -0.1)), (-0.3, (-0.5, -0.1)), (-0.2, (-0.4, 0.1)))
    table = {row[0]: row[3] for row in claims_table(_done(wrong_sign))}
    assert table[hparams] == NOT_REPRODUCED and table[allocation] == INCONCLUSIVE
    both = laws((0.3, (0.1, 0.5)), (-0.3, (-0.5, -0.1)), (0.6, (0.3, 0.9)))
    assert {row[0]: row[3] for row in claims_table(_done(both))}[hparams] == REPRODUCED
    table = {row[0]: row[3] for row in claims_table(_done({"scaling": {"laws": {}}}))}
    assert table["Multi-token prediction improves the main model at equal training steps"] == NOT_MEASURED
    def ablations(baseline, no_mtp, no_bias):  # (val loss, load max/mean) per seed
        runs = {name: [{"val_loss": v, "load_max_over_mean": load} for v, load in values]
                for name, values in (("baseline", baseline), ("no_mtp", no_mtp), ("no_bias", no_bias))}
        return {"ablations": {"variants": runs, "steps": 10, "seeds": [1, 2, 3]}}

    mtp, balanced, free = ("Multi-token prediction improves the main model at equal training steps",
                           "Auxiliary-loss-free balancing (the bias update) keeps expert load balanced",
                           "... without hurting the model (no worse loss)")
    clear = ablations([(4.00, 1.2), (4.02, 1.3), (3.99, 1.2)], [(4.10, 1.2), (4.11, 1.3), (4.10, 1.2)],
                      [(4.01, 2.5), (4.02, 2.6), (4.00, 2.4)])
    table = {row[0]: (row[2], row[3]) for row in claims_table(_done(clear))}
    assert table[mtp][1] == REPRODUCED  # +0.10 +- 0.01 over three seeds
    assert table[balanced][1] == REPRODUCED and "1.23 with the bias update, 2.5 without" in table[balanced][0]
    assert table[free][1] == REPRODUCED and "criterion: below 2% beyond the margin" in table[free][0]
    # the earlier design's case: one draw's difference of 0.01 inside a spread of 0.05 is no verdict either way
    noisy = ablations([(4.82, 1.2), (4.70, 1.3), (4.90, 1.2)], [(4.81, 1.2), (4.78, 1.3), (4.85, 1.2)],
                      [(4.80, 2.5), (4.75, 2.6), (4.88, 2.4)])
    table_noisy = {row[0]: (row[2], row[3]) for row in claims_table(_done(noisy))}
    assert table_noisy[mtp][1] == INCONCLUSIVE and table_noisy[balanced][1] == REPRODUCED
    # an inconclusive effect says what would resolve it: differences -0.01, +0.08, -0.05 (mean +0.0067,
    # sd 0.0666) would need more than 100 seeds; a verdict says nothing of seeds
    assert "over 100 paired seeds would not resolve it" in table_noisy[mtp][0]
    assert "seeds would" not in table_noisy[balanced][0]
    hurt = ablations([(4.20, 1.2), (4.25, 1.3), (4.21, 1.2)], [(4.0, 1.2)] * 3, [(4.00, 2.5), (4.02, 2.6), (4.01, 2.4)])
    table_hurt = {row[0]: row[3] for row in claims_table(_done(hurt))}
    assert table_hurt[mtp] == NOT_REPRODUCED and table_hurt[free] == NOT_REPRODUCED  # MTP hurt; the bias cost 5%
    unbalanced = ablations([(4.0, 2.6)] * 3, [(4.1, 2.6)] * 3, [(4.05, 2.5), (4.06, 2.4), (4.04, 2.5)])
    table_unbalanced = {row[0]: (row[2], row[3]) for row in claims_table(_done(unbalanced))}
    assert table_unbalanced[free][1] == NOT_REPRODUCED  # before: reproduced on the loss alone
    assert "did not balance the load" in table_unbalanced[free][0]
    # 2026-11-29's AMD run: without MTP the routing stayed collapsed longer (load 2.7-3.1 against
    # 1.5-1.7 at the end) and the loss was 0.48 higher; the loss alone said "reproduced"
    collapsed = ablations([(5.321, 1.52), (5.330, 1.69), (5.530, 1.61)], [(5.813, 2.70), (5.766, 3.07), (6.034, 3.09)],
                          [(5.172, 3.54), (5.091, 3.72), (5.881, 3.83)])
    measured, verdict = {row[0]: (row[2], row[3]) for row in claims_table(_done(collapsed))}[mtp]
    assert verdict == INCONCLUSIVE and "+0.477 +- 0.036" in measured
    assert "the arms' routing differs: expert load max/mean 2.95 without MTP, 1.61 with it" in measured
    assert "seeds would" not in measured  # more seeds would not remove the confound
    # equally balanced arms (session 31's Xeon run): the loss decides, the text says nothing of routing
    xeon = ablations([(5.352, 1.628), (5.468, 1.849), (5.301, 1.483)], [(5.196, 1.608), (5.212, 1.543), (5.309, 1.905)],
                     [(5.276, 3.697), (5.450, 3.831), (5.161, 3.711)])
    measured, verdict = {row[0]: (row[2], row[3]) for row in claims_table(_done(xeon))}[mtp]
    assert verdict == INCONCLUSIVE and "routing" not in measured and "~5 paired seeds would resolve it" in measured
    one_seed = {"ablations": {"variants": {k: v[:1] for k, v in clear["ablations"]["variants"].items()}}}
    assert {row[0]: row[3] for row in claims_table(_done(one_seed))}[mtp] == INCONCLUSIVE  # no spread, no verdict
    yarn = "YaRN extension makes retrieval work at the longer context"

    def passkey(base: tuple[list[int], list[int]], extended: tuple[list[int], list[int]]) -> dict:
        """Prompt-by-prompt outcomes at 128 and 512 tokens of the context base and its extension."""
        retrieved = {model: {"128": at128, "512": at512} for model, (at128, at512) in
                     (("context_base", base), ("yarn", extended))}
        return {"passkey": {"accuracy": {m: {n: sum(h) / len(h) for n, h in row.items()} for m, row in retrieved.items()},
                            "retrieved": retrieved, "trained_length": {"context_base": 128, "yarn": 512}}}
    blind = passkey(([0] * 20, [0] * 20), ([0] * 20, [0] * 20))
    measured, verdict = {row[0]: (row[2], row[3]) for row in claims_table(_done(blind))}[yarn]
    assert verdict == NOT_REPRODUCED and "retrieves 0% at its own length (128 tokens), so there was nothing to extend" in measured
    seeing = passkey(([1] * 15 + [0] * 5, [0] * 20), ([1] * 15 + [0] * 5, [1] * 10 + [0] * 10))
    measured, verdict = {row[0]: (row[2], row[3]) for row in claims_table(_done(seeing))}[yarn]
    assert verdict == REPRODUCED and "0% before, 50% after YaRN; gain +50.0 points [" in measured
    assert "paired bootstrap over the 20 passkey prompts" in measured and "nothing to extend" not in measured
    # one prompt's difference among 20 is no verdict either way
    close = passkey(([1] * 15 + [0] * 5, [1] + [0] * 19), ([1] * 15 + [0] * 5, [1, 1] + [0] * 18))
    assert {row[0]: row[3] for row in claims_table(_done(close))}[yarn] == INCONCLUSIVE
    worse = passkey(([1] * 15 + [0] * 5, [1] * 10 + [0] * 10), ([1] * 15 + [0] * 5, [0] * 20))
    assert {row[0]: row[3] for row in claims_table(_done(worse))}[yarn] == NOT_REPRODUCED


def test_a_law_whose_optimum_sat_on_a_grid_edge_is_judged_by_what_that_bound_can_do():
    """An optimum on its grid's edge is a bound: a low edge at the largest budgets could flatten a
    growing law (the first sweeps' M_opt: every budget's best model was the smallest the step cap
    allowed, and the fit followed the cap), so the law is inconclusive; at the smallest budget it
    can only steepen it, so the verdict stands and says so."""
    budgets = [1e9, 3.16e9, 1e10, 3.16e10]

    def allocation(interval: tuple[float, float], *edges: tuple[float, str]) -> dict:
        law = {"model_scale": {"exponent": sum(interval) / 2}, "optima": [{"budget": c} for c in budgets],
               "bootstrap": {"model_scale": {"exponent_interval": list(interval)}},
               "edges": [{"study": "isoflop", "budget": c, "axis": "model_scale", "side": side, "value": 2e4}
                         for c, side in edges]}
        return {"scaling": {"laws": {"allocation": law}}}

    claim = "The compute-optimal model scale grows with compute"

    def judged(laws: dict) -> tuple[str, str]:
        return {row[0]: (row[2], row[3]) for row in claims_table(_done(laws))}[claim]

    measured, verdict = judged(allocation((0.2, 0.6), *[(c, "low") for c in budgets]))
    assert verdict == INCONCLUSIVE and "could reverse the verdict" in measured
    assert "C=1e+10 (low edge, 2e+04)" in measured and "C=1e+09" not in measured  # the smallest only steepens
    measured, verdict = judged(allocation((0.2, 0.6), (1e9, "low"), (3.16e9, "low")))
    assert verdict == REPRODUCED and "C=3.16e+09 (low edge, 2e+04): a bound that can only strengthen" in measured
    assert judged(allocation((0.2, 0.6), (3.16e10, "high")))[1] == REPRODUCED  # higher still: steeper
    assert judged(allocation((0.2, 0.6), (3.16e10, "narrow")))[1] == INCONCLUSIVE  # no interior: either way
    # a law against the paper's sign: an edge that could only steepen it toward the paper's undoes that verdict
    assert judged(allocation((-0.6, -0.2), (1e9, "low")))[1] == INCONCLUSIVE
    assert judged(allocation((-0.6, -0.2), (3.16e10, "low")))[1] == NOT_REPRODUCED
    # the lr law shrinks (sign -): a high edge at the smallest budget can only steepen its fall
    hparams = {"batch_tokens": {"exponent": 0.4}, "lr": {"exponent": -0.2}, "optima": [{"budget": c} for c in budgets],
               "bootstrap": {"batch_tokens": {"exponent_interval": [0.2, 0.6]}, "lr": {"exponent_interval": [-0.3, -0.1]}},
               "edges": [{"study": "hparams", "budget": 1e9, "axis": "lr", "side": "high", "value": 8e-3}]}
    laws = {"scaling": {"laws": {"hparams": hparams}}}
    hparams_claim = "Optimal batch size grows and optimal learning rate shrinks with compute, as power laws"
    assert {row[0]: row[3] for row in claims_table(_done(laws))}[hparams_claim] == REPRODUCED
    hparams["edges"][0]["budget"] = 3.16e10
    assert {row[0]: row[3] for row in claims_table(_done(laws))}[hparams_claim] == INCONCLUSIVE


def test_the_r1_claims_compare_the_stages_problem_by_problem():
    """Each R1 stage's held-out outcomes, problem by problem: a gain is judged by its paired
    bootstrap interval, so one or two problems' difference among 100 is no verdict either way."""
    rl_claim, rs_claim, distill_claim = (
        "RL with rule-based rewards raises accuracy over the cold-start model",
        "SFT on rejection-sampled, verified RL outputs carries the RL model's skill",
        "A distilled smaller student keeps most of the teacher's accuracy")

    def right(n: int) -> list[float]:  # the first n of 100 held-out problems solved
        return [1.0] * n + [0.0] * (100 - n)

    def verdicts(cold: int, rl: int, sft: int, student: int, blind: int = 10) -> dict[str, tuple[str, str]]:
        stages = {name: {"eval_accuracy": n / 100, "held_out_outcomes": right(n)}
                  for name, n in (("cold_start", cold), ("grpo", rl), ("sft_rs", sft), ("distill", student))}
        stages["cold_start"]["blind"] = {"answer": "9", "accuracy": blind / 100, "outcomes": right(blind)}
        return {row[0]: (row[2], row[3]) for row in claims_table(_done(stages))}

    clear = verdicts(20, 40, 40, 38)  # +20 points; both learners keep well over 80% of the 40
    assert clear[rl_claim][1] == REPRODUCED and "+20.0 points" in clear[rl_claim][0]
    assert 'over answering "9" to every list (10%): +30.0 points' in clear[rl_claim][0]
    assert clear[rs_claim][1] == REPRODUCED and clear[distill_claim][1] == REPRODUCED
    assert verdicts(20, 40, 40, 20)[distill_claim][1] == NOT_REPRODUCED  # 20 problems lost: half of it
    noise = verdicts(20, 21, 21, 21)  # one problem more: within what resampling the problems gives
    assert noise[rl_claim][1] == INCONCLUSIVE
    assert noise[rs_claim][1] == INCONCLUSIVE and "not established" in noise[rs_claim][0]  # no gain to carry yet
    worse = verdicts(30, 0, 0, 0)  # a GRPO model that solves nothing leaves nothing to keep
    assert worse[rl_claim][1] == NOT_REPRODUCED and worse[distill_claim][1] == NOT_REPRODUCED
    # measured 2026-11-28: GRPO's gain was answering "9" more often (39% against the constant's 36%),
    # and learners that answered "9" to every list "kept 80% of it": no skill, no reproduction
    constant = verdicts(20, 38, 36, 36, blind=36)
    assert constant[rl_claim][1] == INCONCLUSIVE and constant[rs_claim][1] == INCONCLUSIVE
    assert verdicts(20, 60, 36, 58, blind=36)[rs_claim][1] == NOT_REPRODUCED  # the constant's, below 80% of 60
    before_outcomes = {row[0]: row[3] for row in claims_table(_done({
        name: {"eval_accuracy": 0.3, "held_out_outcomes": None} for name in ("cold_start", "grpo", "sft_rs", "distill")}))}
    assert before_outcomes[rl_claim] == NOT_MEASURED  # accuracies alone are not judged


def preset(name: str, *overrides: str) -> ReproduceConfig:
    """``reproduce=<name>`` as recipes/reproduce.py composes and validates it."""
    from omegaconf import OmegaConf

    from data_contract.schema import dataclass_from_dict

    raw = compose("reproduce", overrides=[f"reproduce={name}", *overrides])
    return dataclass_from_dict(ReproduceConfig, OmegaConf.to_container(raw.reproduce, resolve=True), "reproduce").validate()


@pytest.fixture(scope="module")
def carried_build() -> Path:
    """The data cache any recipe builds on its first run, ``$DSL_LIT_CACHE_ROOT/bundled_corpus_v8192``:
    what a GPU machine without ``datasets`` is handed and ``reproduce=gpu_short`` reads."""
    from dsl_lit.config.data import DataConfig
    from dsl_lit.data.cache import prepare_cache

    cache = Path(os.environ["DSL_LIT_CACHE_ROOT"]) / "bundled_corpus_v8192"
    prepare_cache(DataConfig(corpus_dir=str(ROOT / "data" / "corpus"), cache_dir=str(cache)))
    return cache


@pytest.mark.parametrize("name", ["cpu_mini", "smoke", "gpu_small", "gpu_short"])
def test_every_presets_stage_commands_compose_and_validate(name, tmp_path, request):
    """Each training stage's command line (wiring + the preset's overrides) composes under Hydra
    and validates as its recipe would, for the GPU presets too (which no CPU run exercises): the
    check recipes/reproduce.py runs at start-up."""
    from hydra import initialize_config_dir

    from dsl_lit.reproduce.preflight import check_commands, stage_commands

    build = request.getfixturevalue("carried_build") if name == "gpu_short" else None
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = preset(name)
        configs = check_commands(cfg, STAGE_TABLE, tmp_path)
    assert sorted(configs) == sorted(set(STAGES) - {"data", "passkey", "evaluate", "report"})
    hp = pretraining_hparams({}, cfg)  # no finished scaling stage here: the paper's laws stand in
    for stage, train in configs.items():
        if stage != "scaling":
            assert train.trainer.accelerator == cfg.accelerator, stage
    pre = configs["pretrain"]
    assert pre.data.global_batch_size == hp["global_batch_size"] and pre.optim.lr == hp["lr"]
    if name == "gpu_small":  # the model the budget was computed for is the one trained
        assert (pre.model.d_model, pre.model.n_layers, pre.precision.name) == (768, 12, "bf16")
    if name == "gpu_short":  # a bare GPU image: the carried build everywhere, eager, no W&B
        assert cfg.data_build == str(build) and cfg.device == "cuda"
        real = str((build / "shards").resolve().parent)  # the cache's links resolved: its build
        for stage, train in configs.items():
            if stage in ("context_base", "yarn"):  # the passkey documents: a tiny build of their own, no datasets needed
                assert Path(train.data.corpus_dir).parent == ROOT / "data" / "passkey", stage
            elif stage != "scaling":
                assert train.data.cache_dir == real and train.data.fim_rate == 0.0, stage
            if stage != "scaling":
                assert train.trainer.compile is False and not train.logger.wandb.enabled, stage
        sweep = " ".join(stage_commands(cfg, STAGE_TABLE, tmp_path)["scaling"][0])
        assert f"data.cache_dir='{real}'" in sweep and "data.tokenizer_vocab_size=8192" in sweep
        assert "trainer.compile=false" in sweep
        assert pre.precision.name == "bf16" and pre.data.seq_len == 256 and hp["global_batch_size"] == 32


def test_without_datasets_and_lm_eval_gpu_short_reads_the_carried_build_and_skips_the_evaluation(
        carried_build, tmp_path, monkeypatch, caplog):
    """What a bare GPU image does with reproduce=gpu_short: the data stage takes the carried build
    (one line saying why and which), the evaluation is skipped with one line and the report says
    so, a later run tries the evaluation again; without a build the missing pipeline stops the run
    at start-up, and a build that is not there is refused before any stage."""
    import logging

    from hydra import initialize_config_dir

    from dsl_lit.reproduce.preflight import check_packages
    from dsl_lit.reproduce.runner import fingerprints, run_stages, write_marker
    from dsl_lit.reproduce.stages import carried_build as read_build

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = preset("gpu_short", "reproduce.stages=[data,evaluate,report]")
        without_build = preset("gpu_short", "reproduce.data_build=null")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets / lm_eval: ImportError
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ConfigError, match=r"^stage data needs datasets \(.*\): install it, or set reproduce\.data_build"):
        check_packages(without_build, tmp_path)
    check_packages(cfg, tmp_path)
    with pytest.raises(ConfigError, match="holds no finished data build"):
        read_build(str(tmp_path / "nothing"))

    prints = fingerprints(cfg, STAGE_TABLE)  # the checkpoints lm-eval would score: finished
    for stage in EVALUATED:
        (tmp_path / stage).mkdir()
        write_marker(tmp_path / stage, {"fingerprint": prints[stage], "seconds": 1.0,
                                        "results": {"steps": 10, "val_loss": 5.0, "eval_accuracy": 0.3}})
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="dsl_lit.reproduce.stages"):
        run_stages(cfg, STAGE_TABLE, tmp_path, progress=lines.append)
    build = str((carried_build / "shards").resolve().parent)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert len(said) == 1 and "the pipeline does not run" in said[0] and "datasets, which is not installed" in said[0]
    assert build in said[0] and "decontaminate, train_tokenizer, tokenize_pack" in said[0]
    data = json.loads((tmp_path / "data" / MARKER).read_text())["results"]
    assert data["build"] == build and data["documents_out"] > 1000 and data["fim"] is None
    evaluate = [line for line in lines if " evaluate: " in line]
    assert evaluate[1:] == ["stage 2/3 evaluate: skipped: lm_eval cannot be imported (import of lm_eval halted; "
                            "None in sys.modules): the checkpoints are not scored; pip install lm-eval and rerun "
                            "to score them"]
    assert not (tmp_path / "evaluate" / "pretrain").exists()  # no recipe ran
    report = (tmp_path / "report" / "report.md").read_text()
    assert "skipped here: evaluate" in report and "| evaluate | skipped |" in report
    assert "_Not run on this machine: lm_eval cannot be imported" in report
    assert f"every stage read the build `{build}`" in report and "No FIM." in report
    # the next run (lm-eval installed by then) evaluates: a skipped stage is not a finished one
    lines.clear()
    run_stages(cfg, STAGE_TABLE, tmp_path, progress=lines.append)
    assert "stage 1/3 data: finished earlier" in lines[0] and "stage 2/3 evaluate: skipped: " in "".join(lines)


def test_a_typo_in_a_late_stages_overrides_stops_the_run_before_the_first_stage(tmp_path):
    result = reproduce(tmp_path / "run", "reproduce.overrides.distill=['studnet.n_layers=2']")
    assert result.returncode == 2, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "stage distill (recipes/distill.py with reproduce.overrides.distill)" in error[0]
    assert "studnet" in error[0] and not (tmp_path / "run" / "scaling").exists()


@pytest.mark.parametrize("overrides, message", [
    (["reproduce.seq_len=-128"], "reproduce.seq_len=-128 must be a positive integer"),
    # every stage's command composed and validated first (the scaling sweep counts FLOPs to plan its points)
    (["reproduce=smoke", "reproduce.overrides.distill=['studnet.n_layers=2']"], "studnet"),
])
def test_the_runner_checks_every_stage_without_loading_torch(tmp_path, overrides, message):
    """The runner only orchestrates: validating the preset and every stage's command, and refusing
    a bad one, imports neither torch nor Lightning (~8 s here); it preloads them once the first
    stage is about to be forked."""
    argv = [str(ROOT / "recipes" / "reproduce.py"), f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    probe = (f"import runpy, sys\nsys.argv = {argv!r}\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as stop:\n    print('exit', stop.code, sorted({'torch', 'lightning'} & set(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert message in result.stderr, result.stderr[-2000:]
    assert result.stdout.strip() == "exit 2 []", result.stdout


@pytest.mark.parametrize("path", ["/plain/run", "/my runs/it's,[a]=b{c}", "/a\\b", "/ends\\", "q\\'z"])
def test_paths_reach_the_recipes_as_one_value_whatever_they_hold(path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dsl_lit.reproduce.runner import path_override

    override = OverridesParser.create().parse_override(path_override("init_from", path))
    assert override.key_or_group == "init_from" and override.value() == path


@pytest.mark.parametrize("field, value, message", [
    ("seq_len", -128, "reproduce.seq_len=-128 must be a positive integer"),
    ("seq_len", 0, "reproduce.seq_len=0 must be a positive integer"),
    ("micro_batch_size", 0, "reproduce.micro_batch_size=0 must be a positive integer"),
    ("pretrain_tokens", 10**15, "reproduce.pretrain_tokens=1000000000000000 is over 1e+10"),
    # the YaRN claim compares the context base and its extension at their trained lengths
    ("passkey_lengths", [256, 512, 1024], "reproduce.passkey_lengths=[256, 512, 1024] must include 128: the claim"),
    ("passkey_lengths", [128, 256], "reproduce.passkey_lengths=[128, 256] must include 512: the claim"),
])
def test_sizes_that_hang_or_crash_the_start_up_are_one_line(field, value, message):
    """Before: seq_len=-128 hung at start-up (the step-count loop never ended), a huge budget sat
    silent for minutes, micro_batch_size=0 and seq_len=0 were tracebacks (ZeroDivisionError)."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        ReproduceConfig(**{field: value}).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_gpu_preset_is_refused_at_start_up_without_a_gpu(tmp_path):
    """Before: reproduce=gpu_small on a CPU ran until its first stage failed."""
    result = reproduce(tmp_path / "run", "reproduce=gpu_short")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "reproduce=gpu_short trains on a GPU (reproduce.device=cuda) and torch sees none here" in result.stderr
    assert not (tmp_path / "run" / "scaling").exists()


@pytest.mark.parametrize("content, lacks", [("[1, 2]", "a JSON object"), ('{"fingerprint": "ab"}', "a 'results' object"),
                                            ('{"fingerprint": "ab", "results": [1]}', "a 'results' object")])
def test_a_marker_that_is_json_but_not_ours_is_one_line(tmp_path, content, lacks):
    """Before: valid JSON that is not an object, or lacks its results, was a traceback."""
    from dsl_lit.reproduce.runner import marker

    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / MARKER).write_text(content)
    with pytest.raises(ConfigError, match=rf"is not a marker this runner wrote \(it lacks {re.escape(lacks)}\); move "):
        marker(tmp_path / "pretrain")


CHILD = """import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
tmp = out.with_suffix(".tmp")  # written whole, then renamed: the test never reads it half-written
signal.signal(signal.SIGTERM, lambda *_: (tmp.write_text("SIGTERM"), tmp.rename(out), sys.exit(0)))
out.with_suffix(".ready").write_text("")
time.sleep(60)
"""
PARENT = """import subprocess, sys, time
from dsl_lit.reproduce.run_dir_lock import die_with_parent
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], preexec_fn=die_with_parent)
time.sleep(60)
"""


def test_one_run_per_run_dir_and_no_stage_outlives_its_run(tmp_path):
    """Before: two runs on one run dir collided, and a SIGKILLed run left its stage running."""
    from dsl_lit.reproduce.run_dir_lock import hold_run_dir

    fd = hold_run_dir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^another make reproduce \(pid {os.getpid()}\) or one of its stages is running"):
        hold_run_dir(tmp_path)
    os.close(fd)
    os.close(hold_run_dir(tmp_path))  # released with its holder
    out = tmp_path / "child.txt"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(out)], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not out.with_suffix(".ready").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    parent.kill()
    parent.wait()
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.read_text() == "SIGTERM"


@pytest.mark.parametrize("content", ['{"results": {"arc": {"acc,none": 0.5', "[]", '{"configs": {}}'])
def test_a_cut_off_results_file_is_scored_again_not_a_traceback(tmp_path, content, caplog):
    """Before: a truncated per-model results.json (written in place) was a JSON traceback."""
    import logging

    from dsl_lit.reproduce.stages import scored

    (tmp_path / "results.json").write_text(content)
    with caplog.at_level(logging.WARNING):
        assert scored(tmp_path) is None
    assert "is not a complete lm-eval results file (cut off?): scoring this checkpoint again" in caplog.text
    (tmp_path / "results.json").write_text('{"results": {"arc": {"acc,none": 0.5}}}')
    assert scored(tmp_path) == {"arc": {"acc,none": 0.5}}


def test_the_report_states_what_the_files_hold(tmp_path):
    """The report from stage markers alone (no stage runs): its tables hold the markers' numbers;
    a flat fitted exponent reads as flat, not ``C^1.52e-16``; criteria are stated, not asked; the
    R1 bars come in pipeline order after the shortcut rule's baseline, computed on the run's own
    held-out problems; every bar is labelled (a 0% passkey bar was an empty plot)."""
    from dsl_lit.reproduce.report import write_report
    from dsl_lit.reproduce.stages import blind_baseline, shortcut_accuracy

    run_dir = tmp_path / "run"
    task = {"name": "arithmetic", "num_problems": 64, "eval_problems": 8, "max_operand": 9,
            "operations": ["largest"], "list_length": 4, "seed": 0, "language": "en"}
    (run_dir / "cold_start").mkdir(parents=True)
    (run_dir / "cold_start" / "resolved_config.yaml").write_text(yaml.safe_dump({"task": task}))
    shortcut = shortcut_accuracy(run_dir / "cold_start")
    from dsl_lit.config.posttrain import TaskConfig
    from dsl_lit.tasks import arithmetic

    _, held_out = arithmetic.split(TaskConfig(**task).validate())
    assert shortcut == sum(p["question"].split()[-1] == p["answer"] for p in held_out) / 8

    def solved(n: int) -> list[float]:  # the first n of the 8 held-out problems
        return [1.0] * n + [0.0] * (8 - n)

    blind = blind_baseline(run_dir / "cold_start")
    train, _ = arithmetic.split(TaskConfig(**task).validate())
    assert blind["answer"] == "9" == max(set(p["answer"] for p in train), key=[p["answer"] for p in train].count)
    assert blind["outcomes"] == [float(p["answer"] == "9") for p in held_out]

    results = {
        "scaling": {"laws": {"hparams": {"batch_tokens": {"exponent": 1.52e-16}, "lr": {"exponent": -0.125},
                                         "bootstrap": {"batch_tokens": {"exponent_interval": [-0.05, 0.05]},
                                                       "lr": {"exponent_interval": [-0.2, -0.05]}}, "edges": []},
                             "allocation": {"model_scale": {"exponent": 0.61}, "edges": [],
                                            "bootstrap": {"model_scale": {"exponent_interval": [0.4, 0.8]}}}},
                    "batch_interval_sequences": [6, 11], "lr_interval": [2e-3, 4e-3], "clamped": False,
                    "runs_per_round": {"hparams": [36, 9], "isoflop": [14]}, "isoflop_hparams": [[1e9, 2, 8e-3]],
                    "batch_fit_sequences": 8, "lr_fit": 3e-3, "paper_batch_sequences": 2, "paper_lr": 2e-3,
                    "global_batch_size": 8, "lr": 3e-3, "model_scale_M": 1.2e7, "tokens_D": 8192, "compute_C": 9.8e10,
                    "source": "this sweep", "max_steps": 11, "ramp_start": 4, "ramp_tokens": 4915},
        "pretrain": {"val_loss": 4.0, "val_step": 10, "train_loss": 4.1, "load_max_over_mean": 1.2, "steps": 11},
        "ablations": {"steps": 6, "seeds": [1234, 1235], "variants": {
            "baseline": [{"val_loss": 4.0, "train_loss": 3.9, "load_max_over_mean": 1.2},
                         {"val_loss": 4.2, "train_loss": 4.1, "load_max_over_mean": 1.4}],
            "no_mtp": [{"val_loss": 4.1, "train_loss": 4.0, "load_max_over_mean": 1.3},
                       {"val_loss": 4.1, "train_loss": 4.0, "load_max_over_mean": 1.3}],
            "no_bias": [{"val_loss": 4.05, "train_loss": 4.0, "load_max_over_mean": 2.5},
                        {"val_loss": 4.05, "train_loss": 4.0, "load_max_over_mean": 2.5}]}},
        "context_base": {"steps": 1500, "train_loss": 1.25}, "yarn": {"steps": 150, "train_loss": 0.42},
        "passkey": {"accuracy": {"context_base": {"128": 0.5, "512": 0.0}, "yarn": {"128": 0.75, "512": 0.25}},
                    "retrieved": {"context_base": {"128": [1, 0], "512": [0, 0]}, "yarn": {"128": [1, 1], "512": [1, 0]}},
                    "trained_length": {"context_base": 128, "yarn": 512}},
        "cold_start": {"eval_accuracy": 0.25, "shortcut_accuracy": shortcut, "held_out_outcomes": solved(2),
                       "blind": blind},
        "grpo": {"eval_accuracy": 0.5, "held_out_outcomes": solved(4)},
        "sft_rs": {"eval_accuracy": 0.375, "held_out_outcomes": solved(3)},
        "distill": {"eval_accuracy": 0.125, "held_out_outcomes": solved(1)},
    }
    for stage, values in results.items():
        (run_dir / stage).mkdir(parents=True, exist_ok=True)
        (run_dir / stage / MARKER).write_text(json.dumps({"results": values, "seconds": 1.0}))
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = preset("smoke")
    report = write_report(run_dir, tmp_path / "report", cfg).read_text()
    assert "B_opt ~ C^0 (flat: the optimum did not move between budgets) [-0.050, 0.050], lr_opt ~ C^-0.125 [-0.200, -0.050]" in report
    assert "M_opt ~ C^0.610 [0.400, 0.800]" in report and "| its 5-95% bootstrap interval | [6, 11] | [0.002, 0.004] |" in report
    assert "used (the fit's, unclamped)" in report and "runs per round: hparams [36, 9], isoflop [14]" in report and "e-16" not in report and "?)" not in report
    assert "each budget (C=1e+09: 2 sequence(s), lr 0.008)" in report and "is a bound on the true one" in report
    assert "(criterion: below 2% beyond the margin)" in report and "(criterion: both above 0 at both ends)" in report
    assert "gain +25.0 points [" in report  # GRPO over the cold start, with its interval
    assert "| baseline | 4.1 +- 0.141 | 4 +- 0.141 | 1.3 +- 0.141 |" in report  # mean +- sd over the seeds
    assert "Ablations: 2 seeds (1234, 1235) per variant, 6 steps each" in report
    rows = [line for line in report.split("## 5.")[1].splitlines() if line.startswith("| ") and "accuracy" not in line]
    assert rows == [f'| always "9" | {blind["accuracy"]:.4g} |', f"| shortcut rule | {shortcut:.4g} |",
                    "| cold_start | 0.25 |", "| grpo | 0.5 |",
                    "| sft_rs | 0.375 |", "| distill | 0.125 |"]
    assert "| pretrain | 11 | 4.1 | 4 | 10 | 1.2 |" in report  # its last validation came after step 10 of 11
    context = report.split("## 4.")[1].split("## 5.")[0]
    assert "| 128 | 0.5 | 0.75 |" in context and "| 512 | 0 | 0.25 |" in context
    assert "| context_base | 1500 | 1.25 |" in context and "| yarn | 150 | 0.42 |" in context
    for png in ("passkey.png", "r1_accuracy.png"):
        assert (tmp_path / "report" / png).stat().st_size > 5000


def test_the_seed_and_the_ablations_are_set_from_the_command_line(tmp_path):
    """``reproduce.seed=`` on the command line (before: refused by Hydra, the key missing from the
    presets) reaches every training stage, the ablations seed k as seed + k, one command per run."""
    from hydra import initialize_config_dir

    from dsl_lit.reproduce.preflight import stage_commands

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = preset("cpu_mini", "reproduce.seed=7", "reproduce.ablation_seeds=2")
    assert (cfg.seed, cfg.ablation_seeds, cfg.ablation_fraction, cfg.concurrent_runs) == (7, 2, 0.5, 2)
    commands = stage_commands(cfg, STAGE_TABLE, tmp_path)
    for stage in ("scaling", "pretrain", "context_base", "yarn", "cold_start", "grpo", "sft_rs", "distill"):
        assert [a for a in commands[stage][0] if a.startswith("trainer.seed=")] == ["trainer.seed=7"], stage
    seeds = [next(a for a in c if a.startswith("trainer.seed=")) for c in commands["ablations"]]
    assert seeds == ["trainer.seed=7", "trainer.seed=8"] * 3 and len(commands["ablations"]) == 6
    # the runs without MTP (the shortest) last, so the last wave's lone run idles a core the least
    assert ["++model.mtp_depth=0" in c for c in commands["ablations"]] == [False] * 4 + [True] * 2


@pytest.mark.parametrize("committed", ["", "seed1"])
def test_the_committed_report_states_what_its_run_measured(committed: str):
    """docs/reproduce/report.md is the committed run's report (seed1/: the same chain with
    ``reproduce.seed=1``): its verdict table is what today's claims make of that run's results
    (results.json beside it), row for row, so a changed criterion cannot leave an old verdict
    standing in the README's report."""
    docs = ROOT / "docs" / "reproduce" / committed
    results = json.loads((docs / "results.json").read_text())
    report = (docs / "report.md").read_text()
    rows = claims_table({stage: {"results": r} for stage, r in results.items()})
    assert len(rows) == 9
    for statement, source, measured, verdict in rows:
        assert f"| {statement} | {source} | {measured} | {verdict} |" in report, statement
    assert sum(verdict == REPRODUCED for *_, verdict in rows) == report.count(f"| {REPRODUCED} |")


def test_an_inconclusive_effect_is_given_the_seeds_that_would_resolve_it():
    """The seeds a paired effect needs, were the spread what was measured: the smallest n whose
    one-sided 95% margin t(n-1) sd / sqrt(n) is under the mean's distance from the criterion."""
    from dsl_lit.reproduce.claims import MOST_SEEDS, Paired, t_95

    mtp = Paired((0.156, 0.256, -0.008))  # session 31's seeds: -0.135 +- 0.133 the other way round
    assert mtp.seeds_to_resolve(0.0) == 5  # n=4: 2.353 x 0.133 / 2 = 0.157 > 0.135; n=5: 0.127 < 0.135
    assert Paired((0.01, 0.01, 0.01)).seeds_to_resolve(0.0) is None  # no spread: nothing to plan from
    assert Paired((0.02, -0.02, 0.0)).seeds_to_resolve(0.0) is None  # mean on the criterion: never
    assert Paired((0.5, -0.4, 0.0)).seeds_to_resolve(0.0) is None and MOST_SEEDS == 100
    # past the table, the approximation stays within 0.02 of Student's t (10, 20, 30 dof: 1.812, 1.725, 1.697)
    for dof, exact in ((10, 1.812), (20, 1.725), (30, 1.697)):
        assert abs(t_95(dof) - exact) < 0.02
