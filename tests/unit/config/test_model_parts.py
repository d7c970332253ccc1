"""A model config made of parts: every preset stores and answers what it did before the parts
existed (a fixture written by the code of that day), each field belongs to exactly the parts that
read it, and a field the family's parts do not read is a one-line error."""

from __future__ import annotations

import dataclasses
import json

import pytest

from data_contract.errors import ConfigError
from dsl_lit.config.families import CARDS, PART_KINDS, part_fields, presets
from dsl_lit.config.families.card import FamilyCard
from dsl_lit.config.model import ModelConfig
from dsl_lit.config.model_parts.attention import GroupedQueryShape
from dsl_lit.config.model_parts.moe import DeepSeekMoE
from dsl_lit.config.model_parts.mtp import MultiTokenPrediction
from tests.fixtures.make_model_config_answers import PATH, all_answers

SHARED = ("name", "family", "vocab_size", "n_layers", "d_model", "n_heads", "ffn_hidden", "max_seq_len", "rope_theta",
          "norm_eps", "init_std", "tie_embeddings", "attn_backend", "rope_scaling", "extra")
"""The fields every model has (no part owns them)."""


def test_every_preset_stores_and_answers_what_it_did_before_the_parts() -> None:
    """Stored config (dataclasses.asdict, what checkpoints keep), shapes, FLOPs, the planner's
    per-token figures and the unused fields of the 13 presets of that day, against the fixture (a
    preset added since is not in it)."""
    expected = json.loads(PATH.read_text())
    got = json.loads(json.dumps(all_answers(), sort_keys=True))
    assert len(expected) == 13 and set(expected) <= set(got)
    for name in expected:
        assert got[name] == expected[name], name


def test_every_field_is_shared_or_read_by_a_part() -> None:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    owned = set(part_fields())
    assert owned <= fields
    assert fields - owned == set(SHARED), "a field neither shared nor read by any part"
    assert not owned & set(SHARED)
    used = {type(p) if not isinstance(p, type) else p for card in CARDS.values() for p in card.parts}
    assert {type(p) if not isinstance(p, type) else p for p in PART_KINDS} == used, "a part no family uses"


@pytest.mark.parametrize("preset, field, value, owner", [
    ("deepseek_llm_tiny", "n_routed_experts", 32, "routed experts (DeepSeekMoE)"),
    ("deepseek_llm_tiny", "kv_lora_rank", 32, "latent attention (MLA)"),
    ("deepseek_llm_tiny", "mtp_depth", 1, "multi-token prediction"),
    ("deepseek_v3_tiny", "index_topk", 8, "a lightning indexer"),
    ("deepseek_v3_tiny", "hc_mult", 2, "DeepSeek-V4's hyper-connections"),
    ("deepseek_v4_tiny", "n_expert_groups", 2, "routed experts (DeepSeekMoE)"),
    ("deepseek_v4_tiny", "ffn_hidden", 64, "a use for ffn_hidden"),
])
def test_a_field_the_family_does_not_read_is_a_one_line_error(preset, field, value, owner) -> None:
    cfg = ModelConfig.from_name(preset, **{field: value})
    with pytest.raises(ConfigError) as error:
        cfg.refuse_unused([field])
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"model.{field} is not used by model.name={preset}")
    assert owner in message
    cfg.refuse_unused([f for f in SHARED if f != "ffn_hidden"])  # shared fields are always read


def test_a_family_is_its_parts_plus_its_rules() -> None:
    """A new family is a card: its parts give it fields, checks and shape answers, nothing else is
    touched (what ``ARCHITECTURE.md`` lists for a family's config)."""
    card = FamilyCard(name="dense_gqa_with_mtp", presets={}, base_preset="-", attention=GroupedQueryShape,
                      mtp=MultiTokenPrediction())
    assert card.reads("n_kv_heads") and card.reads("mtp_depth") and not card.reads("kv_lora_rank")
    cfg = ModelConfig(family="deepseek_llm", n_kv_heads=3)
    with pytest.raises(ConfigError, match=r"^model\.n_kv_heads=3 does not divide model\.n_heads=32"):
        card.validate(cfg, "model")
    card_moe = dataclasses.replace(card, moe=DeepSeekMoE(score_funcs=("softmax",)))
    bad = dataclasses.replace(cfg, n_kv_heads=8, n_routed_experts=8, n_activated_experts=2, moe_ffn_hidden=64,
                              n_dense_layers=1)
    with pytest.raises(ConfigError, match=r"^model\.score_func='sigmoid': the deepseek_llm family routes with softmax"):
        card_moe.validate(bad, "model")
    card_moe.validate(dataclasses.replace(bad, score_func="softmax"), "model")
    assert card_moe.moe.routes(bad, 1) and not card_moe.moe.routes(bad, 0)


def test_presets_come_from_the_cards() -> None:
    assert set(presets()) == {p for card in CARDS.values() for p in card.presets}
    for name, values in presets().items():
        assert CARDS[values["family"]].presets[name].items() <= values.items()
