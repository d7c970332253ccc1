"""DeepSeek LLM (arXiv 2401.02954): grouped-query attention and a dense SwiGLU in every block,
released in the Llama layout (its card, presets and field checks: ``dsl_lit.config.families``); the
tensor-parallel plan in ``parallelize``, the Hugging Face names in
``hf_adapter``; what it builds is ``spec``; its FLOPs and pipeline stage costs follow from the
composition (``dsl_lit.models.common.flops``)."""
