"""Continued pretraining: ``init_from`` in the pretrain recipe takes a checkpoint's weights, or an
HF export of them, with a fresh optimizer, schedule and data position, under any layout."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.conftest import ROOT
from tests.forked_python import run_python
from tests.recipe_runs import losses, run_recipe

RUN = ["logger=csv", "trainer.accelerator=cpu", "checkpoint.every_minutes=0", "checkpoint.async_save=false",
       "model=deepseek_llm_tiny"]


@pytest.mark.slow
def test_init_from_a_checkpoint_or_its_hf_export_under_any_layout(tmp_path):
    base = tmp_path / "base"
    run_recipe(base, *RUN, "trainer.max_steps=6", "checkpoint.every_n_steps=6")
    step = base / "checkpoints" / "step-6"
    export = tmp_path / "hf"
    run_python([sys.executable, str(ROOT / "recipes" / "export_hf.py"), f"checkpoint={step}", f"output={export}"],
               cwd=ROOT).check_returncode()

    fresh = losses(base)
    runs = {}
    # a model field on the command line that init_from's architecture would drop: one line, exit 2
    # (before: the checkpoint's 2 layers trained without a word)
    refused = run_recipe(tmp_path / "refused", *RUN, f"init_from={step}", "model.n_layers=1", succeed=False)
    assert refused.returncode == 2
    assert "model.n_layers=1 is ignored with init_from=" in refused.stderr and "(model.n_layers=2)" in refused.stderr
    # the kernels are the run's own (the same function): model.attn_backend on the command line is used
    for name, source, layout in (("ckpt", step, []), ("hf", export, []),
                                 ("pp2", base, ["trainer.devices=2", "parallel=pp_1f1b", "++model.attn_backend=eager"])):
        run_dir = tmp_path / name
        run_recipe(run_dir, *RUN, "trainer.max_steps=2", "checkpoint.every_n_steps=2", f"init_from={source}", *layout)
        runs[name] = losses(run_dir)
        state = torch.load(run_dir / "checkpoints" / "step-2" / "trainer_state.pt", weights_only=True)
        assert state["PretrainDataModule"]["consumed_samples"] == 2 * 8  # data from the start
        meta = json.loads((run_dir / "checkpoints" / "step-2" / "meta.json").read_text())
        assert meta["global_step"] == 2  # a fresh optimizer and schedule
    # the same first batch as the base run's step 0, scored by trained weights
    assert float(runs["ckpt"][0]) < float(fresh[0]) - 0.5
    assert runs["hf"] == runs["ckpt"]  # fp32 export: the same weights bit for bit
    assert float(runs["pp2"][0]) == pytest.approx(float(runs["ckpt"][0]), rel=1e-5)
    resolved = (tmp_path / "pp2" / "resolved_config.yaml").read_text()
    assert "attn_backend: eager" in resolved and "attn_backend: sdpa" in (tmp_path / "ckpt" / "resolved_config.yaml").read_text()
