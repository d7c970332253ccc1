"""Where DeepSeek-V4's compression windows lie in a row, and which of them a query may see.

A compressed layer pools every ``rate`` tokens of a document into one key, counting windows from
the document's first token; a query sees the complete windows of its own document that it has
passed. A row holds one document (from its first real token: a left-padded batch, a KV cache) or
several packed ones (SFT's rows: the per-query mask of ``posttrain/chat/rows.py: document_mask``).
:class:`Windows` describes both alike: each complete window's first token, its place in its
document and the document itself, so that pooling is one gather over (document, window) groups of
the whole batch, never a loop over documents. A document's partial last window is no window at all,
as it would be with the document alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def document_starts(same_document: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's document, as the index of its first token; whether a token begins one) [batch,
    seq] of a per-query mask [batch, seq, seq], read from whether each token attends the one before."""
    batch, seq = same_document.shape[:2]
    continues = same_document[:, 1:, :-1].diagonal(dim1=1, dim2=2)  # token i + 1 attends token i
    begins = torch.cat([continues.new_ones(batch, 1), ~continues], dim=1)
    first = torch.where(begins, torch.arange(seq, device=same_document.device), 0).cummax(dim=1).values
    return first, begins


def check_documents(same_document: torch.Tensor) -> None:
    """A ValueError unless the per-query mask [batch, seq, seq] is packed documents: query i attends
    key j <= i exactly when both lie in one run of tokens (once per forward: it waits for the device)."""
    first, _ = document_starts(same_document)
    causal = torch.ones(same_document.shape[1:], dtype=torch.bool, device=first.device).tril()
    if not bool(((same_document == (first.unsqueeze(-1) == first.unsqueeze(-2))) | ~causal).all()):
        raise ValueError("DeepSeek-V4 reads a per-query key_valid as packed documents "
                         "(query i attends key j <= i exactly when both are in one run of tokens); pass "
                         "posttrain.chat.rows.document_mask(doc_ids) or a [batch, keys] padding mask")


def passed(positions: torch.Tensor, index: torch.Tensor, rate: int) -> torch.Tensor:
    """[..., seq, windows]: whether a query at ``positions`` [..., seq] (in its document) has seen all
    of the tokens of the window ``index`` [..., windows] of its document (window w holds positions
    w * rate .. w * rate + rate - 1)."""
    return index.unsqueeze(-2) < ((positions + 1) // rate).unsqueeze(-1)


@dataclass(frozen=True)
class Windows:
    """The complete compression windows of each row of a batch, in row order, padded to a common
    count (a padding window belongs to document -1, which no query is in)."""

    rate: int
    start: torch.Tensor
    """[batch, windows]: the first token of each window (its index in the row of keys)."""
    index: torch.Tensor
    """[batch, windows]: its place in its document: rotated at ``index * rate``; CSA's window pools
    the previous one's tokens too unless it is its document's first."""
    document: torch.Tensor
    """[batch, windows]: its document (-1: a padding window)."""
    query_document: torch.Tensor
    """[batch or 1, queries]: the document of each query."""

    @classmethod
    def of_rows(cls, rate: int, length: int, first: torch.Tensor | None = None,
                device: torch.device | None = None) -> Windows:
        """One document per row over ``length`` tokens, from its ``first`` token [batch] (None: 0; the
        tokens before it, a left-padded row's pads, are in no window)."""
        device = first.device if first is not None else device
        index = torch.arange(length // rate, device=device).unsqueeze(0)
        start = index * rate if first is None else first.unsqueeze(-1) + index * rate
        document = torch.where(start + rate <= length, 0, -1)
        return cls(rate, start, index.expand_as(start), document, torch.zeros(1, 1, dtype=torch.long, device=device))

    @classmethod
    def of_keys(cls, key_valid: torch.Tensor | None, length: int, rate: int, device: torch.device) -> Windows:
        """The windows of rows of ``length`` keys: one document per row from its first real token
        (``key_valid`` [batch, keys]: a left-padded batch; None: from the first), or the packed
        documents of a per-query mask ``key_valid`` [batch, seq, seq] (:meth:`of_documents`)."""
        if key_valid is None:
            return cls.of_rows(rate, length, device=device)
        if key_valid.dim() == 3:
            return cls.of_documents(key_valid, rate)
        return cls.of_rows(rate, length, first=key_valid[:, :length].long().argmax(-1))  # right pads stay put

    @classmethod
    def of_documents(cls, same_document: torch.Tensor, rate: int) -> Windows:
        """The windows of packed documents, from a per-query mask ``same_document`` [batch, seq, seq]
        (query i may attend key j: they are in one document, as ``document_mask`` makes it; a
        document is a run of tokens, :func:`check_documents`)."""
        batch, seq = same_document.shape[:2]
        token = torch.arange(seq, device=same_document.device)
        first, begins = document_starts(same_document)
        next_begin = torch.where(begins, token, seq)
        end = torch.cat([next_begin[:, 1:], next_begin.new_full((batch, 1), seq)], dim=1)
        end = end.flip(1).cummin(dim=1).values.flip(1)  # each token's document ends before the next begins
        offset = token - first
        opens = (offset % rate == 0) & (token + rate <= end)  # a complete window starts here
        windows = seq // rate  # no row holds more complete windows
        slot = torch.where(opens, opens.long().cumsum(1) - 1, windows)  # the rest go to a column dropped below

        def placed(values: torch.Tensor, fill: int) -> torch.Tensor:
            out = values.new_full((batch, windows + 1), fill)
            return out.scatter_(1, slot, values)[:, :windows]

        return cls(rate, placed(token.expand(batch, -1), 0), placed(offset // rate, 0), placed(first, -1), first)

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """[batch, seq, windows] bool: the windows of its own document a query at ``positions``
        [batch, seq] (in its document) has passed."""
        own = self.document.unsqueeze(1) == self.query_document.unsqueeze(-1)
        return own & passed(positions, self.index, self.rate)
