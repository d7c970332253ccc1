"""Inference over the plain models: batched generation with the KV cache (greedy, sampling,
stop strings) and MTP speculative decoding. Used by post-training (rollouts, rejection
sampling), evaluation and the training loop's in-loop evaluation; imports only the models."""
