"""DeepSeek-V3 (arXiv 2412.19437): Multi-head Latent Attention, DeepSeekMoE with node-limited
routing and auxiliary-loss-free balancing, multi-token prediction; DeepSeek-V2 beside it (``v2``,
and DeepSeek-V3.2, ``v32``; their cards, presets and field checks are ``dsl_lit.config.families``);
the tensor-parallel plan in ``parallelize``; the Hugging Face names in ``hf_adapter`` (V2:
``v2_hf_adapter``), on the checkpoint layout both share (``hf_layout``); what it builds is ``spec``;
its FLOPs and pipeline stage costs follow from the composition (``dsl_lit.models.common.flops``)."""
