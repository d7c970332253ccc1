"""Near and exact dedup on planted duplicates of known Jaccard: recall, precision, nothing below 0.5."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline.config import load_config
from data_pipeline.dedup.lsh_bands import candidate_probability, choose_bands
from data_pipeline.dedup.minhash import MinHasher, jaccard_of_signatures, shingle_hashes, words
from data_pipeline.dedup.near_dedup_cluster import components, partition_of
from data_pipeline.dedup.union_find import connected_components
from data_pipeline.io.shards import read_marker
from data_pipeline.runner import plan, run
from data_pipeline.synthetic import jaccard, planted_corpus
from tests.conftest import scratch_dir

TARGETS = [0.3, 0.45, 0.6, 0.7, 0.8, 0.85, 0.88, 0.9, 0.93, 0.96, 0.99]


def write_jsonl(path: Path, texts: list[str], ids: list[str], source: str = "web") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, t in zip(ids, texts):
            f.write(json.dumps({"id": i, "text": t, "source": source}) + "\n")
    return path


def pipeline(input_path: Path, output_dir: Path, stages: list[str], **overrides) -> dict:
    values = {
        "input": {"path": str(input_path)},
        "output_dir": str(output_dir),
        "stages": stages,
        **overrides,
    }
    stats = run(load_config(values))
    assert stats is not None
    return stats


def removed_rows(output_dir: Path) -> list[dict]:
    files = sorted((output_dir / "removed").glob("*.parquet"))
    return [r for f in files for r in pq.read_table(f).to_pylist()]


def kept_ids(output_dir: Path) -> list[str]:
    return [
        i
        for f in sorted((output_dir / "kept").glob("*.parquet"))
        for i in pq.read_table(f).column("id").to_pylist()
    ]


@pytest.fixture(scope="module")
def corpus():
    return planted_corpus(num_originals=660, words_per_doc=120, targets=TARGETS, seed=3)


@pytest.fixture(scope="module")
def dedup_run(corpus, request: pytest.FixtureRequest) -> Path:
    root = scratch_dir(request, "near")
    half = len(corpus.texts) // 2  # two input files -> two shards: pairs cross shards
    write_jsonl(root / "in" / "a.jsonl", corpus.texts[:half], corpus.ids[:half])
    write_jsonl(root / "in" / "b.jsonl", corpus.texts[half:], corpus.ids[half:])
    pipeline(root / "in", root / "out", ["near_dedup"], near_dedup={"save_index": True})
    return root / "out"


def test_word_splitting_matches_the_regex() -> None:
    texts = ["Hello, World! it's 2024", "中文한국어 mixed_words ok", "", "Ünïcode façade — “quoted”"]
    _, counts = shingle_hashes(texts, 1)
    assert counts.tolist() == [len(words(t)) for t in texts]


def test_minhash_estimates_jaccard(corpus) -> None:
    pairs = corpus.pairs[:150]
    for scheme in ("oph", "classic"):
        sigs = MinHasher(scheme=scheme).signatures(corpus.texts)
        errors = [jaccard_of_signatures(sigs[a], sigs[b]) - j for a, b, j in pairs]
        assert abs(np.mean(errors)) < 0.02 and np.std(errors) < 0.06, scheme


def test_bands_are_chosen_for_recall_at_the_threshold() -> None:
    bands, rows = choose_bands(112, 0.8, 0.95)
    assert bands * rows <= 112
    assert candidate_probability(0.8, bands, rows) >= 0.95
    assert candidate_probability(0.85, bands, rows) >= 0.99
    assert candidate_probability(0.3, bands, rows) < 0.01


def test_union_find_labels_components_by_their_minimum() -> None:
    edges = np.array([[5, 3], [3, 9], [1, 2], [7, 7], [9, 4]])
    labels = connected_components(10, edges)
    assert labels.tolist() == [0, 1, 1, 3, 3, 3, 6, 7, 8, 3]


def test_partition_forests_merge_into_the_components_of_all_edges() -> None:
    """The cluster/merge scheme on random graphs: union-find per partition of the smaller node,
    each partition's forest (node -> its component's minimum), union-find over the forests."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        edges = np.sort(rng.integers(-30, 400, size=(int(rng.integers(1, 300)), 2)), axis=1)
        edges = edges[edges[:, 0] != edges[:, 1]]
        nodes, roots = components(edges)
        part = partition_of(edges[:, 0], 1 + trial % 7)
        forests = []
        for p in np.unique(part):
            n, r = components(edges[part == p])
            forests.append(np.stack([n, r], axis=1)[n != r])
        merged_nodes, merged_roots = components(np.concatenate(forests))
        assert merged_nodes.tolist() == nodes.tolist() and merged_roots.tolist() == roots.tolist()
        duplicates = set(nodes[nodes != roots].tolist())  # what merge holds: duplicates only
        assert {int(n) for f in forests for n in f[:, 0]} <= duplicates


def test_near_dedup_recall_precision_and_floor(corpus, dedup_run: Path) -> None:
    removed = {r["id"]: r for r in removed_rows(dedup_run)}
    ids = corpus.ids
    high = [(a, b, j) for a, b, j in corpus.pairs if j >= 0.85]
    low = [(a, b, j) for a, b, j in corpus.pairs if j < 0.5]
    assert len(high) > 250 and len(low) > 100
    recall = np.mean([ids[b] in removed for _, b, _ in high])
    assert recall >= 0.97, recall
    assert not [ids[b] for _, b, _ in low if ids[b] in removed]  # nothing below Jaccard 0.5
    assert not [ids[a] for a, _, _ in corpus.pairs if ids[a] in removed]  # originals come first: kept
    text = dict(zip(ids, corpus.texts))
    true_pos = [jaccard(text[i].split(), text[r["duplicate_of"]].split()) >= 0.8 for i, r in removed.items()]
    assert np.mean(true_pos) >= 0.99  # precision with exact verification
    assert {r["reason"] for r in removed.values()} == {"near_duplicate"}
    assert sorted(kept_ids(dedup_run) + list(removed)) == sorted(ids)


def test_any_number_of_cluster_partitions_removes_the_same_documents(
    corpus, dedup_run: Path, tmp_path: Path
) -> None:
    """dedup_run clusters in 8 partitions (the default); one partition is the unpartitioned
    clustering. Same removals (with the same duplicate_of), kept documents and index; no
    partition held all the candidate pairs."""
    root = dedup_run.parent
    one = pipeline(
        root / "in",
        tmp_path / "one",
        ["near_dedup"],
        near_dedup={"save_index": True, "cluster_partitions": 1},
    )
    eight = json.loads((dedup_run / "stats.json").read_text())
    for sub in ("kept", "removed", "near_dedup_index"):
        files = sorted(p.relative_to(dedup_run) for p in (dedup_run / sub).rglob("*") if p.is_file())
        assert files == sorted(
            p.relative_to(tmp_path / "one") for p in (tmp_path / "one" / sub).rglob("*") if p.is_file()
        )
        assert all((dedup_run / f).read_bytes() == (tmp_path / "one" / f).read_bytes() for f in files), sub
    details = one["stages"]["near_dedup"]["details"]["near_dedup.merge"]
    assert details == {
        **eight["stages"]["near_dedup"]["details"]["near_dedup.merge"],
        "cluster_partitions": 1,
    }
    assert details["duplicates"] > 250
    values = {
        "input": {"path": str(root / "in")},
        "output_dir": str(dedup_run),
        "stages": ["near_dedup"],
        "near_dedup": {"save_index": True},
    }
    cluster = next(p for p in plan(load_config(values)) if p.step.name == "near_dedup.cluster")
    held = [read_marker(cluster.context.step_dir, u)["candidate_pairs"] for u in range(cluster.num_units)]
    assert len(held) == 8 and sum(held) == details["candidate_pairs"] and max(held) < sum(held) / 4


def test_cross_run_dedup_against_the_persistent_index(corpus, dedup_run: Path, tmp_path: Path) -> None:
    index = dedup_run / "near_dedup_index"
    assert json.loads((index / "meta.json").read_text())["documents"] == len(kept_ids(dedup_run))
    # a later "dump": exact and near copies of earlier originals, plus new documents
    new = planted_corpus(num_originals=40, words_per_doc=120, targets=[0.0], seed=99)
    near = [(a, b, j) for a, b, j in corpus.pairs if j >= 0.9][:30]
    texts = [corpus.texts[b] for _, b, _ in near] + new.texts
    ids = [f"later-{i}" for i in range(len(texts))]
    write_jsonl(tmp_path / "in.jsonl", texts, ids)
    pipeline(
        tmp_path / "in.jsonl", tmp_path / "out", ["near_dedup"], near_dedup={"against_indexes": [str(index)]}
    )
    removed = {r["id"]: r for r in removed_rows(tmp_path / "out")}
    caught = [i for i in ids[: len(near)] if i in removed]
    assert len(caught) >= 0.9 * len(near)
    assert {removed[i]["reason"] for i in caught} == {"near_duplicate_of_index"}
    assert all(removed[i]["duplicate_of"] in set(corpus.ids) for i in caught)
    assert not [i for i in ids[len(near) :] if i in removed]
    with pytest.raises(ValueError, match="near_dedup.num_perm"):
        pipeline(
            tmp_path / "in.jsonl",
            tmp_path / "out2",
            ["near_dedup"],
            near_dedup={"against_indexes": [str(index)], "num_perm": 128},
        )


def test_exact_dedup_keeps_the_first_and_is_idempotent(tmp_path: Path) -> None:
    texts = ["alpha beta gamma", "delta", "alpha beta gamma", "delta", "epsilon", "alpha beta gamma"]
    ids = [f"d{i}" for i in range(len(texts))]
    write_jsonl(tmp_path / "in" / "1.jsonl", texts[:3], ids[:3])
    write_jsonl(tmp_path / "in" / "2.jsonl", texts[3:], ids[3:])
    stats = pipeline(tmp_path / "in", tmp_path / "out", ["exact_dedup"], exact_dedup={"partitions": 3})
    removed = {r["id"]: r["duplicate_of"] for r in removed_rows(tmp_path / "out")}
    assert removed == {"d2": "d0", "d3": "d1", "d5": "d0"}
    assert stats["stages"]["exact_dedup"]["removed"] == {"exact_duplicate": 3}
    again = pipeline(tmp_path / "out" / "kept", tmp_path / "again", ["exact_dedup"])
    assert again["stages"]["exact_dedup"]["removed"] == {}
    assert kept_ids(tmp_path / "again") == ["d0", "d1", "d4"]
    assert (
        pa.concat_tables([pq.read_table(f) for f in sorted((tmp_path / "again" / "kept").glob("*"))]).num_rows
        == 3
    )
