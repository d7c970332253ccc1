"""DeepSeek-V3 (arXiv 2412.19437): Multi-head Latent Attention, DeepSeekMoE with node-limited
routing and auxiliary-loss-free balancing, multi-token prediction. Presets in ``presets``, field
checks in ``validation``, the tensor-parallel plan in ``parallelize``, the Hugging Face names in
``hf_adapter``; its FLOPs and pipeline stage costs follow from the composition
(``dsl_lit.models.common.flops``)."""

from dsl_lit.models.common.block import Composition
from dsl_lit.models.common.mla import MultiHeadLatentAttention
from dsl_lit.models.common.moe import TopKRouter
from dsl_lit.models.deepseek_v3.hf_adapter import V3_ADAPTER
from dsl_lit.models.deepseek_v3.parallelize import tp_plan
from dsl_lit.models.deepseek_v3.presets import PRESETS
from dsl_lit.models.deepseek_v3.validation import validate
from dsl_lit.models.registry import FamilySpec

SPEC = FamilySpec(
    name="deepseek_v3",
    presets=PRESETS,
    base_preset="deepseek_v3_tiny",
    composition=Composition(attention=MultiHeadLatentAttention, router=TopKRouter, mtp=True),
    validate=validate,
    tp_plan=tp_plan,
    hf_adapter=V3_ADAPTER,
    hf_readers=(V3_ADAPTER,),
)
