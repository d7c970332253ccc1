"""The README's copy-and-edit example, made as it says: ``recipes/pretrain.py`` copied, the README's
module class added above ``main`` and handed to ``fit``; its loss adds a z-loss computed from the logits
before the in-place cross-entropy, and a custom metric."""

from __future__ import annotations

import csv
import math
import os
import re
import sys

import pytest

from tests.conftest import ROOT
from tests.forked_python import run_python
from tests.recipe_runs import SMALL

HEADING = "### Copy a recipe and edit its loss"
FIT = "fit(cfg, PretrainModule(**module_arguments(cfg), initial_state=initial_state), datamodule)"


def readme_edit() -> tuple[str, str]:
    """(the class, the ``fit`` line) of the README's copy-and-edit section: its two python blocks."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(HEADING):]
    section = section[:section.index("\n### ", len(HEADING))]
    assert "cp recipes/pretrain.py recipes/my_pretrain.py" in section
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, blocks
    return blocks[0], blocks[1].strip()


def copied_recipe() -> str:
    """``recipes/pretrain.py`` with the README's edit."""
    code, fit_line = readme_edit()
    recipe = (ROOT / "recipes" / "pretrain.py").read_text(encoding="utf-8")
    assert recipe.count(FIT) == 1 and recipe.count("\n@hydra.main(") == 1
    recipe = recipe.replace(FIT, fit_line).replace("\n@hydra.main(", f"\n{code}\n\n@hydra.main(")
    compile(recipe, "my_pretrain.py", "exec")
    return recipe


def test_the_readme_shows_a_recipe_edit_with_a_z_loss_and_a_metric():
    code, fit_line = readme_edit()
    assert "class MyPretrain(PretrainModule)" in code and "logsumexp" in code and "accuracy" in code
    assert fit_line == FIT.replace("PretrainModule(", "MyPretrain(")
    assert "class MyPretrain(PretrainModule)" in copied_recipe()


@pytest.mark.slow
def test_the_readme_copied_recipe_trains_and_logs_its_terms(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "conf").symlink_to(ROOT / "conf")  # where the copy's config_path="../conf" points
    recipe = tmp_path / "recipes" / "my_pretrain.py"
    recipe.write_text(copied_recipe(), encoding="utf-8")
    run_dir = tmp_path / "run"
    # fp32 on the CPU: logits.float() is the logits themselves, which logsumexp saves for its
    # backward, which runs after the cross-entropy's (the autograd error of issue 41 before the fix)
    result = run_python(
        [sys.executable, str(recipe), *SMALL, "trainer.max_steps=3", "logger=csv", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, timeout=600, env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    for key in ("train/loss", "train/z_loss", "train/accuracy", "train/mtp_loss"):
        values = [float(r[key]) for r in rows if r.get(key)]
        assert len(values) == 3 and all(math.isfinite(v) for v in values), (key, values)
    z_losses = [float(r["train/z_loss"]) for r in rows if r.get("train/z_loss")]
    assert all(0 < z < 1 for z in z_losses)  # 1e-4 x logsumexp^2, logsumexp about ln(vocab)
