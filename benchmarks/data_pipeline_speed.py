"""Data pipeline throughput against its references, in one run: packing against the tokenizer's own
``encode_batch``, and the quality and language filters against their per-document implementation.

    python -m benchmarks.data_pipeline_speed [--repeats 3] [--only pack|quality|language]
        [--tokenizer bundled|deepseek_llm|deepseek_v3] [--crawl-docs 3000] [--baseline 6198ce4]

- pack: ``Tokenizer.encode_batch`` over every document of the bundled corpus in one call (the
  library's peak: its Rust threads see the whole corpus at once, no Python in between) against
  ``tokenize_pack`` on the same documents (an in-memory dataset, as a ``tokenize_pack`` unit reads
  its shard) up to the published shard directory, both with all cores; a tokenizer of the chosen
  spec is first trained on the corpus (vocab 8192). Wall-clock MB/s (the goal's ratio) and MB per
  CPU-second of all threads (what the packing adds in work, whatever else the machine runs).
- quality / language: the stage's batch function (what ``datasets.map`` calls per 1000 documents)
  over the bundled corpus and a crawl-like one (``benchmarks/crawl_corpus.py``), in child processes
  with one thread each, for this checkout and for ``--baseline`` (a commit from before the
  vectorised filters, exported with ``git archive``; for the language filter that is py3langid's
  own ``classify`` per document). Speeds are MB of text per CPU-second (``time.process_time``), so
  other work on a shared machine slows them less than wall-clock speeds; the children also report
  a digest of their verdicts (and of the language scores and texts they return), which must agree.

Every measurement is the median over ``--repeats`` interleaved rounds (before, after, before, ...).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.headline import headline
from dsl_lit.utils.machine import cpu_description

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "corpus"
BASELINE = "6198ce4"  # the last commit with per-document filters
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def bundled_texts() -> list[str]:
    texts = []
    for path in sorted(CORPUS.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def megabytes(texts: list[str]) -> float:
    return sum(len(t.encode("utf-8")) for t in texts) / 1e6


def bench_pack(texts: list[str], spec: str, repeats: int, tmp: Path) -> list[str]:
    import datasets
    import pyarrow as pa
    from tokenizers import Tokenizer

    from data_pipeline.stages.tokenize_pack import tokenize_pack
    from data_pipeline.tokenizer.training import tokenizer_spec, train_tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    tokenizer_dir = train_tokenizer(texts, 8192, tmp / "tokenizer", spec=tokenizer_spec(spec))
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    dataset = datasets.Dataset(pa.table({"text": texts}))
    out = tmp / "packed"

    def pack() -> None:
        shutil.rmtree(out, ignore_errors=True)
        tokenize_pack(dataset, tokenizer_dir, out)

    candidates = {"encode_batch": lambda: tokenizer.encode_batch(texts, add_special_tokens=False),
                  "tokenize_pack": pack}
    wall: dict[str, list[float]] = {name: [] for name in candidates}
    cpu: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(1 + repeats):  # the first round warms up
        for name, fn in candidates.items():
            start_cpu, start = time.process_time(), time.perf_counter()
            fn()
            if round_:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    size = megabytes(texts)
    speed = {name: size / statistics.median(wall[name]) for name in candidates}
    per_core = {name: size / statistics.median(cpu[name]) for name in candidates}
    ratio = speed["tokenize_pack"] / speed["encode_batch"]
    headline(f"tokenize_pack / Tokenizer.encode_batch throughput ({spec} spec)", ratio, "x", ">= 0.5x")
    return [f"| pack ({spec} spec, {os.cpu_count()} threads), wall | encode_batch {speed['encode_batch']:.2f} "
            f"| tokenize_pack {speed['tokenize_pack']:.2f} | {ratio:.2f}x | |",
            f"| pack, per CPU-second | encode_batch {per_core['encode_batch']:.2f} "
            f"| tokenize_pack {per_core['tokenize_pack']:.2f} "
            f"| {per_core['tokenize_pack'] / per_core['encode_batch']:.2f}x | |"]


def child(stage: str, texts_file: Path) -> None:
    """Time the stage's batch function over the texts once (after a small warm-up); print JSON."""
    import pyarrow.parquet as pq

    texts = pq.read_table(texts_file).column("text").to_pylist()
    import data_pipeline

    if stage == "quality":
        from data_pipeline.stages.quality_filter import QualityFilterConfig, _Judge

        fn = _Judge(QualityFilterConfig())
    else:
        from data_pipeline.stages.language_filter import _identify_batch as fn
    fn({"text": texts[:50]})  # lazy tables and models
    digest = hashlib.sha256()
    cpu, wall = time.process_time(), time.perf_counter()
    results = [fn({"text": texts[i : i + 1000]}) for i in range(0, len(texts), 1000)]
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    for batch in results:
        digest.update(json.dumps(batch, sort_keys=True).encode("utf-8", "surrogatepass"))
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "digest": digest.hexdigest(),
                      "code": str(Path(data_pipeline.__file__).resolve().parent)}))


def run_child(stage: str, texts_file: Path, pythonpath: str) -> dict[str, Any]:
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": pythonpath}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.data_pipeline_speed", "--child", stage, "--texts", str(texts_file)],
        cwd=texts_file.parent, env=env, capture_output=True, text=True, check=False,  # not ROOT: -m puts cwd first
    )
    if result.returncode != 0:
        raise RuntimeError(f"{stage} child failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def export_baseline(commit: str, tmp: Path) -> Path:
    """``data_pipeline`` and ``src`` of ``commit`` under ``tmp/baseline``."""
    target = tmp / "baseline"
    target.mkdir()
    archive = subprocess.run(["git", "archive", commit, "data_pipeline", "src"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def bench_filter(stage: str, corpora: dict[str, Path], sizes: dict[str, float], baseline: Path,
                 repeats: int) -> list[str]:
    paths = {"before": f"{baseline}/src:{baseline}:{ROOT}", "after": f"{ROOT}/src:{ROOT}"}
    rows = []
    for name, texts_file in corpora.items():
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for _ in range(repeats):
            for which, pythonpath in paths.items():
                runs[which].append(run_child(stage, texts_file, pythonpath))
                assert runs[which][-1]["code"] == str((Path(pythonpath.split(":")[1]) / "data_pipeline").resolve())
        speed = {w: sizes[name] / statistics.median(r["cpu_s"] for r in runs[w]) for w in runs}
        same = len({r["digest"] for w in runs for r in runs[w]}) == 1
        ratio = speed["after"] / speed["before"]
        headline(f"{stage} filter MB/s per core, after / before ({name})", ratio, "x",
                 ">= 3x, same verdicts" if same else "DIFFERENT VERDICTS")
        rows.append(f"| {stage} ({name}, 1 core) | before {speed['before']:.2f} | after {speed['after']:.2f} "
                    f"| {ratio:.2f}x | {'yes' if same else 'NO'} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["pack", "quality", "language"])
    parser.add_argument("--tokenizer", default="deepseek_llm", choices=["bundled", "deepseek_llm", "deepseek_v3"])
    parser.add_argument("--crawl-docs", type=int, default=3000, help="documents of the crawl-like corpus")
    parser.add_argument("--baseline", default=BASELINE, help="commit whose filters are 'before'")
    parser.add_argument("--child", choices=["quality", "language"], help=argparse.SUPPRESS)
    parser.add_argument("--texts", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.texts)
        return
    texts = bundled_texts()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.only in (None, "pack"):
            rows += bench_pack(texts, args.tokenizer, args.repeats, tmp)
        if args.only in (None, "quality", "language"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            from benchmarks.crawl_corpus import CrawlCorpus

            corpora = {"bundled": texts, f"crawl-like {args.crawl_docs}": CrawlCorpus(0).batch(args.crawl_docs)}
            files = {}
            for name, docs in corpora.items():
                files[name] = tmp / f"{len(files)}.parquet"
                pq.write_table(pa.table({"text": docs}), files[name])
            sizes = {name: megabytes(docs) for name, docs in corpora.items()}
            baseline = export_baseline(args.baseline, tmp)
            for stage in ("quality", "language"):
                if args.only in (None, stage):
                    rows += bench_filter(stage, files, sizes, baseline, args.repeats)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\n{cpu_description()}; {cores} cores; load average {os.getloadavg()[0]:.1f} at the end; "
          f"bundled corpus {megabytes(texts):.2f} MB; medians of {args.repeats}\n")
    print("| what | reference MB/s | ours MB/s | ratio | same output |")
    print("|---|---:|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    if "--child" not in sys.argv:
        print(f"\n{time.perf_counter() - start:.0f} s")
