"""DeepSeek-V4 on packed documents (SFT's rows: positions restarting at each document and the
per-query mask of ``posttrain/chat/rows.py: document_mask``): each document's logits and gradients
are those it has alone, through every kind of layer (the sliding window never reaches into the
previous document; CSA's and HCA's windows count from each document's first token, the indexer
picks among its own document's windows only), the hash-routed layer and the MTP block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsl_lit.models import build_model
from dsl_lit.posttrain.chat.rows import document_mask
from tests.numerics import assert_close_fp32
from tests.unit.models.test_deepseek_v4_model import LAYERS, VOCAB, D, _cfg, _randomised

ROWS = [[37, 5, 20], [16, 3, 33, 11]]
"""Documents of two rows of 64 (then padding): longer than the sliding window (8), than HCA's (16)
and many CSA windows (4); exactly one HCA window; shorter than a CSA window."""
SEQ = 64


def _packed(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """(ids, positions, doc_ids) [rows, SEQ] of random documents, and each one's (row, start, length)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(ROWS), SEQ), generator=g)
    positions, doc_ids = torch.zeros_like(ids), torch.full_like(ids, -1)
    spans = []
    for r, lengths in enumerate(ROWS):
        start = 0
        for d, n in enumerate(lengths):
            positions[r, start:start + n], doc_ids[r, start:start + n] = torch.arange(n), d
            spans.append((r, start, n))
            start += n
    return ids, positions, doc_ids, spans


def _model(seed: int, **overrides) -> torch.nn.Module:
    """Eight index heads: a window scores exactly 0, a tie that ``torch.topk`` breaks by where the
    window lies in the row (``LightningIndexer.select``), only when all eight ReLUs are zero."""
    return _randomised(build_model(_cfg(index_topk=2, index_n_heads=8, **overrides)), seed=seed)


def test_each_packed_document_computes_what_it_computes_alone():
    model = _model(seed=4).train()
    assert {layer.attention.kind for layer in model.layers.values()} == {"sliding", "csa", "hca"}
    ids, positions, doc_ids, spans = _packed()
    labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(8))
    params = list(model.parameters())

    packed = model(ids, positions, document_mask(doc_ids))
    real = doc_ids >= 0
    packed_grads = torch.autograd.grad(F.cross_entropy(packed[real], labels[real], reduction="sum"), params,
                                       allow_unused=True)
    alone_grads = [torch.zeros_like(p) for p in params]
    for r, start, n in spans:
        alone = model(ids[r:r + 1, start:start + n])[0]
        assert_close_fp32(packed[r, start:start + n], alone, D * LAYERS * SEQ, msg=f"row {r} from {start}")
        grads = torch.autograd.grad(F.cross_entropy(alone, labels[r, start:start + n], reduction="sum"), params,
                                    allow_unused=True)
        alone_grads = [a + g if g is not None else a for a, g in zip(alone_grads, grads)]
    names = [name for name, _ in model.named_parameters()]
    compared = 0
    for name, got, expected in zip(names, packed_grads, alone_grads):
        if got is None:  # the indexers: only their own KL reaches them
            assert "indexer" in name and not expected.any(), name
            continue
        assert_close_fp32(got, expected, D * LAYERS * SEQ, msg=name)
        compared += 1
    assert compared > 100 and all(g is None or g.isfinite().all() for g in packed_grads)
    # the documents are what make it so: read as one document per row, the later ones see the earlier
    with torch.no_grad():
        leaky = model(ids, positions)
        causal = model(ids, positions, document_mask(doc_ids).tril())  # a mask of past keys only reads alike
    assert (leaky[real] - packed[real]).abs().max() > 1e-2 and torch.equal(causal[real], packed[real])


def test_the_mtp_block_follows_packed_documents():
    """MTP depth 1 at position i reads token i + 1: a document's positions but its last are its own."""
    model = _model(seed=5, mtp_depth=1).eval()
    ids, positions, doc_ids, spans = _packed(seed=9)
    mtp = model.mtp["0"]
    with torch.no_grad():
        streams = model.residual(ids, positions, document_mask(doc_ids))
        packed = mtp(streams[:, :-1], model.tok_embeddings(ids[:, 1:]), positions[:, :-1], ids[:, 1:],
                     document_mask(doc_ids[:, :-1]))
        for r, start, n in spans:
            alone = model.residual(ids[r:r + 1, start:start + n])
            expected = mtp(alone[:, :-1], model.tok_embeddings(ids[r:r + 1, start + 1:start + n]),
                           positions[r:r + 1, start:start + n - 1], ids[r:r + 1, start + 1:start + n])
            assert_close_fp32(packed[r, start:start + n - 1], expected[0], D * (LAYERS + 1) * SEQ)


def test_a_per_query_mask_that_is_not_documents_is_refused():
    model = _model(seed=6)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(10))
    interleaved = document_mask(torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]]))
    with pytest.raises(ValueError, match=r"^DeepSeek-V4 reads a per-query key_valid as packed documents .*"
                                         r"document_mask\(doc_ids\)"):
        model(ids, torch.arange(12).unsqueeze(0), interleaved)
