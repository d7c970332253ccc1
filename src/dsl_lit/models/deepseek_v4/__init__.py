"""DeepSeek-V4: manifold-constrained hyper-connections, compressed sparse / heavily compressed
attention with a sliding window, hash-routed and top-k MoE layers, at parity with transformers 5.24 (its card, presets and field
checks: ``dsl_lit.config.families.deepseek_v4``)."""
