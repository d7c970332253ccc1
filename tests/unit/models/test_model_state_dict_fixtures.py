"""Moving model code never renames parameters: state dicts saved by earlier code load unchanged.

``tests/fixtures/*.safetensors`` were written by ``tests/fixtures/make_state_dict_fixtures.py``
with the code as it was before the models moved into ``dsl_lit.models.common`` and the family
folders (the commit is in their metadata). The current code must build a model with exactly the
same state-dict keys and shapes, load the tensors strictly, and compute the same logits (and MTP
logits) for the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dsl_lit.models import ModelConfig, build_model

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
CASES = ("deepseek_v3_small", "deepseek_llm_small")


def _tolerance(expected: torch.Tensor) -> float:
    """fp32 reordering bound: a few ulps of the largest logit per accumulation, scaled by its size
    (the same ops may be reordered by another CPU's kernels, never changed)."""
    return 1e-5 * expected.abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_state_dict_saved_before_the_move_loads_with_the_same_names_and_logits(case: str) -> None:
    path = FIXTURES / f"{case}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    saved = load_file(path)
    expected = load_file(FIXTURES / f"{case}.expected.safetensors")
    model = build_model(ModelConfig.from_name(metadata["preset"], **json.loads(metadata["overrides"]))).eval()
    own = model.state_dict()
    assert sorted(own) == sorted(saved)
    assert {k: tuple(v.shape) for k, v in own.items()} == {k: tuple(v.shape) for k, v in saved.items()}
    model.load_state_dict(saved, strict=True)
    ids = expected["input_ids"]
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        logits = model.head(hidden)
        mtp = model.mtp_logits(hidden, ids)
    torch.testing.assert_close(logits, expected["logits"], atol=_tolerance(expected["logits"]), rtol=0)
    assert len(mtp) == sum(k.startswith("mtp_logits.") for k in expected)
    for k, got in enumerate(mtp):
        want = expected[f"mtp_logits.{k}"]
        torch.testing.assert_close(got, want, atol=_tolerance(want), rtol=0)


def test_fixtures_exercise_what_they_pin() -> None:
    """The V3 fixture holds MoE blocks with a non-zero balancing bias and an MTP module, so names of
    every kind of module are pinned; the logits are far from zero, so a wrong wiring shows."""
    saved = load_file(FIXTURES / "deepseek_v3_small.safetensors")
    assert any(k.startswith("mtp.0.") for k in saved)
    biases = [v for k, v in saved.items() if k.endswith("gate.expert_bias")]
    assert biases and all(b.abs().min() > 0 for b in biases)
    assert load_file(FIXTURES / "deepseek_v3_small.expected.safetensors")["logits"].abs().max() > 1.0
