"""DeepSeek-V4: manifold-constrained hyper-connections, compressed sparse / heavily compressed
attention with a sliding window, hash-routed and top-k MoE layers (being assembled: the attention
and mHC modules are here and at parity with transformers 5.24; the family is not registered yet)."""
