"""The real recipe on 2 and 4 gloo processes: data parallel (plain and ZeRO-1) and tensor parallel give
the per-step losses and gradient norms of one process on the same global batch, for both model
families; a tensor-parallel checkpoint resumes on one process."""

from __future__ import annotations

import pytest

from tests.test_pretrain_e2e import losses, metric, run_recipe

STEPS = ["trainer.max_steps=6", "logger=csv", "trainer.accelerator=cpu", "data.micro_batch_size=2"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek_v3_tiny", "deepseek_llm_tiny"])
def test_data_parallel_and_zero1_match_one_process(tmp_path, model):
    runs = {
        "single": ["trainer.devices=1"],
        "dp2": ["trainer.devices=2"],
        "dp2_zero1": ["trainer.devices=2", "parallel=zero1"],
        "tp2": ["trainer.devices=2", "parallel.tp=2"],
        "dp2_tp2": ["trainer.devices=4", "parallel.tp=2"],
    }
    if model == "deepseek_llm_tiny":  # the V3 case covers plain DP and the 2-D mesh; keep the suite short
        del runs["dp2"], runs["dp2_tp2"]
    results = {}
    for name, overrides in runs.items():
        run_recipe(tmp_path / name, f"model={model}", *STEPS, "checkpoint.every_n_steps=0", *overrides)
        results[name] = (losses(tmp_path / name), metric(tmp_path / name, "train/grad_norm"))
    reference_losses, reference_norms = results.pop("single")
    assert sorted(reference_losses) == list(range(6))
    for name, (run_losses, norms) in results.items():
        assert sorted(run_losses) == list(range(6)), name
        for step in range(6):
            assert float(run_losses[step]) == pytest.approx(float(reference_losses[step]), rel=2e-3), (name, step)
            assert float(norms[step]) == pytest.approx(float(reference_norms[step]), rel=1e-4), (name, step)
    # one Hydra output directory per run, not one per rank
    assert not list(tmp_path.glob("*/.hydra/*rank*"))


@pytest.mark.slow
def test_tensor_parallel_checkpoint_resumes_on_one_process(tmp_path):
    """Checkpoints hold full tensors (weights and AdamW moments) whatever the layout."""
    tp_run, single = tmp_path / "tp", tmp_path / "single"
    run_recipe(tp_run, *STEPS, "trainer.devices=2", "parallel.tp=2", "checkpoint.every_n_steps=3")
    run_recipe(single, *STEPS, "trainer.devices=1",
               f"checkpoint.resume_from={tp_run / 'checkpoints' / 'step-3'}")
    tp_losses, resumed = losses(tp_run), losses(single)
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        assert float(resumed[step]) == pytest.approx(float(tp_losses[step]), rel=1e-5), step


@pytest.mark.slow
def test_zero1_checkpoint_resumes_under_zero1_and_on_one_process(tmp_path):
    """ZeRO-1 saves a plain AdamW state (moments gathered per parameter), so a rerun resumes
    exactly and another layout can continue from it."""
    full, resumed, single = tmp_path / "full", tmp_path / "resumed", tmp_path / "single"
    zero1 = ["trainer.devices=2", "parallel=zero1"]
    run_recipe(full, *STEPS, *zero1, "checkpoint.every_n_steps=0")
    run_recipe(resumed, *STEPS, *zero1, "checkpoint.every_n_steps=3", "trainer.max_steps=3")
    run_recipe(resumed, *STEPS, *zero1, "checkpoint.every_n_steps=3")  # same run dir: resumes from step-3
    run_recipe(single, *STEPS, "trainer.devices=1", f"checkpoint.resume_from={resumed / 'checkpoints' / 'step-3'}")
    assert losses(resumed) == losses(full)  # bit for bit
    for step in (3, 4, 5):
        assert float(losses(single)[step]) == pytest.approx(float(losses(full)[step]), rel=1e-5), step
