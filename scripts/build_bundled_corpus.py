"""Build the small bundled pretraining corpus from two public-domain texts shipped by Debian.

Why: tests and the CPU demo need real English that is licence-clean and available offline. This is
a developer tool run once; its output under ``data/corpus/`` is committed and never rebuilt at
training time.

Inputs (extract them first, see ``data/corpus/README.md``):
  * the King James Bible as printed by ``bible "Gen1:1-Rev22:21"`` (Debian ``bible-kjv``),
  * ``devil.dict.dz`` + ``devil.index`` from Debian ``dict-devil`` (dictd format).

Usage::

    python scripts/build_bundled_corpus.py --kjv /tmp/deb/kjv.txt \
        --devil-dict /path/usr/share/dictd/devil.dict.dz --out data/corpus
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

# "Genesis 1", "1 Samuel 3", "Song of Solomon 2": a chapter heading printed by `bible`.
_CHAPTER_RE = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z ]*[a-z] \d+$")
# "  12 And the earth brought forth ...": the first line of a verse.
_VERSE_RE = re.compile(r"^\s+\d+ (.*)$")
_DICTD_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def kjv_documents(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """One document per chapter: the heading as the first line, then the verses as flowing text."""
    title: str | None = None
    verses: list[list[str]] = []

    def flush() -> Iterator[dict[str, str]]:
        if title is not None:
            body = " ".join(" ".join(parts) for parts in verses)
            yield {"id": f"kjv/{title}", "text": f"{title}\n{body}", "source": "kjv_bible"}

    for raw in lines:
        line = raw.rstrip()
        if not line:
            continue
        if _CHAPTER_RE.match(line):
            yield from flush()
            title, verses = line, []
            continue
        verse = _VERSE_RE.match(line)
        if verse:
            verses.append([verse.group(1).strip()])
        elif verses:  # a wrapped continuation line of the current verse
            verses[-1].append(line.strip())
        else:
            raise ValueError(f"unexpected line before the first verse: {line!r}")
    yield from flush()


def _dictd_int(code: str) -> int:
    """dictd encodes offsets and lengths in its own base64 digits."""
    value = 0
    for ch in code:
        value = value * 64 + _DICTD_B64.index(ch)
    return value


def devil_documents(dict_dz: Path, index: Path) -> Iterator[dict[str, str]]:
    """One document per dictionary entry, in book order; dictd's ``00-database-*`` headers skipped."""
    with gzip.open(dict_dz, "rb") as f:  # dictzip files are valid gzip streams
        data = f.read()
    seen: set[tuple[int, int]] = set()
    entries: list[tuple[int, int, str]] = []
    for row in index.read_text(encoding="utf-8").splitlines():
        headword, off, length = row.split("\t")
        span = (_dictd_int(off), _dictd_int(length))
        if headword.startswith("00database") or span in seen:  # several headwords can share an entry
            continue
        seen.add(span)
        entries.append((*span, headword))
    texts: set[str] = set()
    ids: dict[str, int] = {}
    for off, length, headword in sorted(entries):
        lines = data[off : off + length].decode("utf-8").splitlines()
        text = "\n".join(line.rstrip() for line in lines).strip()
        if not text or text in texts:  # the source prints PRECEDENT and PRECIPITATE twice
            continue
        texts.add(text)
        ids[headword] = ids.get(headword, 0) + 1  # REASON is both a verb and a noun entry
        suffix = "" if ids[headword] == 1 else f"#{ids[headword]}"
        yield {"id": f"devil/{headword}{suffix}", "text": text, "source": "devils_dictionary"}


def write_jsonl_gz(records: Iterable[dict[str, str]], path: Path) -> tuple[int, int]:
    """Write deterministically (gzip mtime=0, no file name in the header); return (docs, text bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    docs = nbytes = 0
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        with io.TextIOWrapper(gz, encoding="utf-8", newline="\n") as out:
            for rec in records:
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                docs += 1
                nbytes += len(rec["text"].encode("utf-8"))
    tmp.replace(path)
    return docs, nbytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kjv", type=Path, default=Path("/tmp/deb/kjv.txt"))
    parser.add_argument(
        "--devil-dict",
        type=Path,
        default=Path("/tmp/deb/x_dict-devil_1.0-13.1_all.deb/usr/share/dictd/devil.dict.dz"),
        help="devil.dict.dz; devil.index is read from the same directory",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "corpus")
    args = parser.parse_args(argv)

    with open(args.kjv, encoding="utf-8") as f:
        kjv = write_jsonl_gz(kjv_documents(f), args.out / "kjv_bible.jsonl.gz")
    index = args.devil_dict.with_name(args.devil_dict.name.removesuffix(".dict.dz") + ".index")
    devil = write_jsonl_gz(devil_documents(args.devil_dict, index), args.out / "devils_dictionary.jsonl.gz")
    for name, (docs, nbytes) in (("kjv_bible", kjv), ("devils_dictionary", devil)):
        print(f"{name}: {docs} documents, {nbytes} bytes of text")


if __name__ == "__main__":
    main()
