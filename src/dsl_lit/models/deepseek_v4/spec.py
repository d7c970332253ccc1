"""What DeepSeek-V4 builds (``dsl_lit.models.registry.FamilySpec``): :class:`V4Transformer`."""

from __future__ import annotations

from dsl_lit.config.families.deepseek_v4 import CARD
from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.family_spec import FamilySpec
from dsl_lit.models.common.moe import TopKRouter
from dsl_lit.models.deepseek_v4.attention import V4Attention
from dsl_lit.models.deepseek_v4.hf_adapter import V4_ADAPTER
from dsl_lit.models.deepseek_v4.model import V4Transformer
from dsl_lit.models.deepseek_v4.parallelize import tp_plan

SPEC = FamilySpec(
    card=CARD,
    composition=Composition(attention=V4Attention, router=TopKRouter),
    tp_plan=tp_plan,
    hf_adapter=V4_ADAPTER,
    hf_readers=(V4_ADAPTER,),
    model=V4Transformer,
)
