"""DeepSeek-V3.2 (DeepSeek-V3.2-Exp): DeepSeek-V3's blocks with DeepSeek Sparse Attention
(``models/common/dsa.py``: MLA over the keys a lightning indexer selects)."""

from __future__ import annotations

from dsl_lit.config.families.deepseek_v32 import CARD
from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.dsa import SparseLatentAttention
from dsl_lit.models.common.family_spec import FamilySpec
from dsl_lit.models.common.moe import TopKRouter
from dsl_lit.models.deepseek_v3.parallelize import tp_plan
from dsl_lit.models.deepseek_v3.v32_hf_adapter import V32_ADAPTER

SPEC = FamilySpec(
    card=CARD,
    composition=Composition(attention=SparseLatentAttention, router=TopKRouter),
    tp_plan=tp_plan,
    hf_adapter=V32_ADAPTER,
    hf_readers=(V32_ADAPTER,),
)
