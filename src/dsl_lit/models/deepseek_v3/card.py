"""DeepSeek-V3's card: what a config knows of the family, without torch (``dsl_lit.models.families``)."""

from dsl_lit.models.common.attention_shape import LatentAttentionShape
from dsl_lit.models.deepseek_v3.presets import PRESETS
from dsl_lit.models.deepseek_v3.validation import validate
from dsl_lit.models.families import FamilyCard

CARD = FamilyCard(
    name="deepseek_v3",
    presets=PRESETS,
    base_preset="deepseek_v3_tiny",
    attention=LatentAttentionShape,
    moe=True,
    mtp=True,
    validate=validate,
    spec_module="dsl_lit.models.deepseek_v3.spec",
)
