"""The real recipe on 2 gloo processes: data parallel, plain and with ZeRO-1, gives the per-step
losses and gradient norms of one process on the same global batch, for both model families."""

from __future__ import annotations

import pytest

from tests.test_pretrain_e2e import losses, metric, run_recipe

STEPS = ["trainer.max_steps=6", "checkpoint.every_n_steps=0", "logger=csv", "trainer.accelerator=cpu",
         "data.micro_batch_size=2"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek_v3_tiny", "deepseek_llm_tiny"])
def test_data_parallel_and_zero1_match_one_process(tmp_path, model):
    runs = {
        "single": ["trainer.devices=1"],
        "dp2": ["trainer.devices=2"],
        "dp2_zero1": ["trainer.devices=2", "parallel=zero1"],
    }
    if model == "deepseek_llm_tiny":
        del runs["dp2"]  # the V3 case covers plain DP; keep the suite short
    results = {}
    for name, overrides in runs.items():
        run_recipe(tmp_path / name, f"model={model}", *STEPS, *overrides)
        results[name] = (losses(tmp_path / name), metric(tmp_path / name, "train/grad_norm"))
    reference_losses, reference_norms = results.pop("single")
    assert sorted(reference_losses) == list(range(6))
    for name, (run_losses, norms) in results.items():
        assert sorted(run_losses) == list(range(6)), name
        for step in range(6):
            assert float(run_losses[step]) == pytest.approx(float(reference_losses[step]), rel=2e-3), (name, step)
            assert float(norms[step]) == pytest.approx(float(reference_norms[step]), rel=1e-3), (name, step)
    # one Hydra output directory per run, not one per rank
    assert not list(tmp_path.glob("*/.hydra/*rank*"))
