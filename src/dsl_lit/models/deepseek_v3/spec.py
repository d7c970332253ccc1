"""What DeepSeek-V3 builds: MLA and DeepSeekMoE with its router, MTP modules (``dsl_lit.models.registry``)."""

from dsl_lit.config.families.deepseek_v3 import CARD
from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.family_spec import FamilySpec
from dsl_lit.models.common.mla import MultiHeadLatentAttention
from dsl_lit.models.common.moe import TopKRouter
from dsl_lit.models.deepseek_v3.hf_adapter import V3_ADAPTER
from dsl_lit.models.deepseek_v3.parallelize import tp_plan

SPEC = FamilySpec(
    card=CARD,
    composition=Composition(attention=MultiHeadLatentAttention, router=TopKRouter),
    tp_plan=tp_plan,
    hf_adapter=V3_ADAPTER,
    hf_readers=(V3_ADAPTER,),
)
