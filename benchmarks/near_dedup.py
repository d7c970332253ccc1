"""Near-dedup throughput and recall: ours vs datasketch's MinHashLSH vs datatrove's MinHash stages.

    python -m benchmarks.near_dedup [--originals 3000] [--words 300] [--datatrove-python /tmp/dt-venv/bin/python]

One synthetic corpus with planted near duplicates of known Jaccard (data_pipeline.synthetic); every
system runs single-process on it, so docs/s is per core. Recall: planted variants with Jaccard >= 0.85
that were removed; precision: removed documents that are planted variants of Jaccard >= 0.8 (the
threshold); "< 0.5 removed" must stay 0. datatrove needs xxhash<4 and runs from its own virtualenv
(``--datatrove-python``) as a subprocess; if it is absent the table says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from data_pipeline.config import load_config
from data_pipeline.synthetic import PlantedCorpus, planted_corpus

TARGETS = [0.3, 0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.0, 0.0, 0.0]

DATATROVE_SCRIPT = r"""
import json, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupSignature, MinhashDedupBuckets,
    MinhashDedupCluster, MinhashDedupFilter)
src, work = sys.argv[1], sys.argv[2]
cfg = MinhashConfig()  # 5-grams, 14 buckets x 8 hashes, 64-bit
start = time.perf_counter()
for steps in (
    [JsonlReader(src), MinhashDedupSignature(output_folder=f"{work}/sigs", config=cfg)],
    [MinhashDedupBuckets(input_folder=f"{work}/sigs", output_folder=f"{work}/buckets", config=cfg)],
    [MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/remove_ids", config=cfg)],
    [JsonlReader(src), MinhashDedupFilter(input_folder=f"{work}/remove_ids",
        exclusion_writer=JsonlWriter(f"{work}/removed", compression=None)), JsonlWriter(f"{work}/kept", compression=None)],
):
    tasks = cfg.num_buckets if isinstance(steps[0], MinhashDedupBuckets) else 1
    LocalPipelineExecutor(pipeline=steps, tasks=tasks, workers=1, logging_dir=f"{work}/logs/{time.time_ns()}").run()
seconds = time.perf_counter() - start
import glob
removed = [json.loads(l)["id"] for f in glob.glob(f"{work}/removed/*") for l in open(f)]
print(json.dumps({"seconds": seconds, "removed": removed}))
"""


def score(corpus: PlantedCorpus, removed: set[str]) -> dict[str, float]:
    ids = corpus.ids
    high = [ids[b] for _, b, j in corpus.pairs if j >= 0.85]
    low = [ids[b] for _, b, j in corpus.pairs if j < 0.5]
    true = {ids[b] for _, b, j in corpus.pairs if j >= 0.8}
    return {
        "recall@0.85": float(np.mean([i in removed for i in high])),
        "precision": float(np.mean([i in true for i in removed])) if removed else 1.0,
        "removed<0.5": sum(i in removed for i in low),
    }


def run_ours(corpus: PlantedCorpus, work: Path, scheme: str) -> tuple[float, set[str]]:
    """The near_dedup stage end to end (parquet in and out, all four steps), one process."""
    from data_pipeline.runner import run

    src = work / f"ours-{scheme}.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(corpus.ids, corpus.texts)))
    out = work / f"ours-{scheme}"
    cfg = load_config(
        {
            "input": {"path": str(src)},
            "output_dir": str(out),
            "stages": ["near_dedup"],
            "near_dedup": {"scheme": scheme},
        }
    )
    run(cfg)  # includes ingest (JSON parsing), as datatrove's reader does
    stats = json.loads((out / "stats.json").read_text())
    seconds = stats["stages"]["near_dedup"]["seconds"] + stats["stages"]["ingest"]["seconds"]
    import pyarrow.parquet as pq

    removed = {
        i for f in (out / "removed").glob("*.parquet") for i in pq.read_table(f).column("id").to_pylist()
    }
    return seconds, removed


def run_datasketch(corpus: PlantedCorpus) -> tuple[float, set[str]] | str:
    try:
        from datasketch import MinHash, MinHashLSH
    except ImportError:
        return "not installed (pip install datasketch)"

    start = time.perf_counter()
    lsh = MinHashLSH(threshold=0.8, num_perm=112)
    removed = set()
    for doc_id, text in zip(corpus.ids, corpus.texts):
        words = text.lower().split()
        shingles = {" ".join(words[i : i + 5]).encode() for i in range(max(len(words) - 4, 1))}
        m = MinHash(num_perm=112)
        m.update_batch(list(shingles))
        if lsh.query(m):
            removed.add(doc_id)
        else:
            lsh.insert(doc_id, m)
    return time.perf_counter() - start, removed


def run_datatrove(corpus: PlantedCorpus, work: Path, python: str) -> tuple[float, set[str]] | str:
    if not Path(python).exists():
        return f"not run: no datatrove environment at {python}"
    src = work / "dt-in"
    src.mkdir()
    (src / "docs.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(corpus.ids, corpus.texts))
    )
    proc = subprocess.run(
        [python, "-c", DATATROVE_SCRIPT, str(src), str(work / "dt")], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return "failed: " + proc.stderr.strip().splitlines()[-1]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["seconds"], set(result["removed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--originals", type=int, default=3000)
    parser.add_argument("--words", type=int, default=300)
    parser.add_argument("--datatrove-python", default="/tmp/dt-venv/bin/python")
    args = parser.parse_args()
    corpus = planted_corpus(args.originals, args.words, TARGETS, seed=0)
    n = len(corpus.texts)
    print(
        f"corpus: {n} documents of {args.words} words, {len(corpus.pairs)} planted near duplicates; 1 process each\n"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = {
            "ours (oph, near_dedup stage)": run_ours(corpus, work, "oph"),
            "ours (classic, near_dedup stage)": run_ours(corpus, work, "classic"),
            "datasketch MinHashLSH": run_datasketch(corpus),
            "datatrove MinHash (4 stages)": run_datatrove(corpus, work, args.datatrove_python),
        }
    print("| system | docs/s/core | seconds | recall J>=0.85 | precision | removed J<0.5 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, result in results.items():
        if isinstance(result, str):
            print(f"| {name} | {result} | | | | |")
            continue
        seconds, removed = result
        s = score(corpus, removed)
        rows.append((name, n / seconds))
        print(
            f"| {name} | {n / seconds:,.0f} | {seconds:.2f} | {s['recall@0.85']:.3f} | {s['precision']:.3f} |"
            f" {s['removed<0.5']} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
