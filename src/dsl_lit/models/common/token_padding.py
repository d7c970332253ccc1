"""Zero-padding of token rows to a kernel's multiple, cropped afterwards.

Why: GPU kernels fix some dims to multiples (FP8 ``_scaled_mm``: 16; blockwise FP8: 128; FP8
grouped GEMMs: every expert's token group a multiple of 16), while the token count of a step is
whatever the batch gives (MTP sees ``seq - 1`` positions per row, an expert any number of
tokens). The layers that call those kernels pad here instead of asking the user for a batch shape.
Zero rows change no quantisation scale (amaxes ignore them), their outputs are dropped, so their
gradients are zero and add nothing to sums over tokens: the padded computation gives the values of
the unpadded one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def call_with_padded_tokens(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, multiple: int
) -> torch.Tensor:
    """``fn`` on ``x [..., features]``'s tokens as ``[rows, features]`` zero-padded to a multiple of
    ``multiple`` rows; the padding is cropped from the output (``[..., out features]``)."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    pad = (-rows % multiple or (multiple if rows == 0 else 0)) if multiple > 1 else 0  # no token: one group of zeros
    if pad == 0:
        return fn(x)
    out = fn(F.pad(x.reshape(rows, features), (0, 0, 0, pad)))
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def align_token_groups(
    x: torch.Tensor, counts: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens sorted by expert (``x [tokens, dim]``, ``counts [experts]``) laid out again with each
    expert's group starting at a multiple of ``multiple`` and at least ``multiple`` long (so no
    group is empty), zero rows between. Returns ``(padded x, padded counts, positions)``:
    ``padded_x[positions] == x``. The padded length depends only on the shapes (tokens +
    experts x multiple, rounded up; the slack goes to the last group), so no host sync is needed
    and compiled graphs see static shapes."""
    tokens, experts = x.shape[0], counts.numel()
    total = -(-(tokens + experts * multiple) // multiple) * multiple
    padded = ((counts + multiple - 1) // multiple * multiple).clamp_min(multiple)
    padded = torch.cat([padded[:-1], (total - padded[:-1].sum()).reshape(1)])
    start = counts.cumsum(0) - counts
    padded_start = padded.cumsum(0) - padded
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=tokens)
    positions = torch.arange(tokens, device=x.device) - start[expert_of_row] + padded_start[expert_of_row]
    out = x.new_zeros(total, x.shape[-1]).index_copy(0, positions, x)
    return out, padded, positions
