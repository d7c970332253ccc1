"""Tokenizer training and encoding throughput (MB/s) on the bundled corpus, DeepSeek pre-tokenizer.

    python -m benchmarks.tokenizer_speed [--vocab 8192] [--max-bytes 0]

Training runs on the (sampled) corpus text; encoding is ``encode_batch`` over all documents, once
with the Rust thread pool on and once with TOKENIZERS_PARALLELISM=false (one core).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from data_pipeline.io.sources import load_documents

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--max-bytes", type=int, default=0, help="training sample (0: the whole corpus)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        texts = list(load_documents(sorted(CORPUS.glob("*.jsonl.gz")), cache_dir=Path(tmp) / "hf")["text"])
        size = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        from data_pipeline.tokenizer.training import train_tokenizer

        start = time.perf_counter()
        out = train_tokenizer(texts, args.vocab, Path(tmp) / "tok", max_bytes=args.max_bytes or None)
        train_s = time.perf_counter() - start
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
        rows = [("train", train_s, os.cpu_count())]
        tokens = 0
        for label, parallel in (("encode (all cores)", "true"), ("encode (1 core)", "false")):
            os.environ["TOKENIZERS_PARALLELISM"] = parallel
            tok = Tokenizer.from_file(str(out / "tokenizer.json"))
            start = time.perf_counter()
            tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
            rows.append((label, time.perf_counter() - start, os.cpu_count() if parallel == "true" else 1))
        del tokenizer
    print(
        f"corpus: {len(texts)} documents, {size:.2f} MB, vocab {args.vocab}, {tokens:,} tokens "
        f"({size * 1e6 / tokens:.2f} bytes/token)\n"
    )
    print("| step | cores | seconds | MB/s |")
    print("|---|---:|---:|---:|")
    for label, seconds, cores in rows:
        print(f"| {label} | {cores} | {seconds:.2f} | {size / seconds:.2f} |")


if __name__ == "__main__":
    main()
