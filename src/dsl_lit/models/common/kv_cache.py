"""A key/value cache for incremental decoding, shared by both attention kinds.

Each attention layer stores whatever it needs to rebuild its keys and values: grouped-query
attention stores the rotated keys and the values, Multi-head Latent Attention only the compressed
latent and the shared rotary key (which is the point of MLA: a few hundred numbers per token
instead of two per head dimension per head). Buffers are allocated once, for the longest sequence
the caller will decode, so a step writes in place instead of concatenating.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer preallocated buffers [batch, max_len, ...] plus the count of positions filled.

    Every layer writes the same positions during one forward; the model calls :meth:`advance` once
    the forward is done.
    """

    def __init__(self, batch_size: int, max_len: int) -> None:
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0
        self._buffers: dict[int, tuple[torch.Tensor, ...]] = {}

    def update(self, layer_id: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write ``new`` tensors [batch, seq, ...] at the current position; return everything cached
        so far for this layer (positions ``0 .. length + seq - 1``)."""
        seq = new[0].shape[1]
        end = self.length + seq
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; writing up to {end} does not fit")
        if layer_id not in self._buffers:
            self._buffers[layer_id] = tuple(
                t.new_zeros((self.batch_size, self.max_len, *t.shape[2:])) for t in new
            )
        buffers = self._buffers[layer_id]
        for buffer, tensor in zip(buffers, new, strict=True):
            buffer[:, self.length : end] = tensor
        return tuple(buffer[:, :end] for buffer in buffers)

    def advance(self, seq: int) -> None:
        self.length += seq

    def numel_per_token(self) -> int:
        """Cached numbers per token summed over layers (for comparing MLA with GQA)."""
        return sum(b[0, 0].numel() for buffers in self._buffers.values() for b in buffers)
