"""The parts every model family shares: layers, attention kernels and the two attention kinds,
DeepSeekMoE, multi-token prediction, the KV cache, the block and the decoder, and the family-agnostic
halves of the FLOP counts, the tensor-parallel plan vocabulary and the Hugging Face adapters."""
