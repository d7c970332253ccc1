"""DeepSeek LLM's card: what a config knows of the family, without torch (``dsl_lit.models.families``)."""

from dsl_lit.models.common.attention_shape import GroupedQueryShape
from dsl_lit.models.deepseek_llm.presets import PRESETS
from dsl_lit.models.deepseek_llm.validation import validate
from dsl_lit.models.families import FamilyCard

CARD = FamilyCard(
    name="deepseek_llm",
    presets=PRESETS,
    base_preset="deepseek_llm_tiny",
    attention=GroupedQueryShape,
    moe=False,
    mtp=False,
    validate=validate,
    spec_module="dsl_lit.models.deepseek_llm.spec",
)
