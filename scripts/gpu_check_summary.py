"""The summary table of scripts/gpu_check.sh, from what its parts left in its output folder.

    python scripts/gpu_check_summary.py OUT      # prints Markdown (the check saves it as OUT/summary.md)

Reads ``device.txt`` (device and versions), ``parts.tsv`` (each part: passed / failed / timeout and
its seconds), ``collected.txt`` (the tests the check meant to run, as each part's pytest collected
them: tests/conftest.py), ``tests.tsv`` (each test's
outcome, seconds and first error line, one line written the moment it ended: tests/conftest.py)
and the ``HEADLINE`` lines of every ``*.log`` (benchmarks/headline.py). A test collected but
never reported was cut by its part's deadline: "timeout". No torch import: it runs in a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.headline import parse  # noqa: E402


def read_tsv(path: Path, columns: int) -> list[list[str]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            rows.append((line.split("\t") + [""] * columns)[:columns])
    return rows


def cell(text: str) -> str:
    return text.replace("|", "\\|").strip() or "-"


def summary(out: Path) -> str:
    lines = ["# GPU check summary", ""]
    device = out / "device.txt"
    lines += [f"- {line}" for line in device.read_text().splitlines()] if device.exists() else ["- device: unknown"]
    lines += ["", "| part | result | s |", "|---|---|---|"]
    lines += [f"| {cell(a)} | {cell(b)} | {cell(c)} |" for a, b, c in read_tsv(out / "parts.tsv", 3)]
    reported = {row[0]: row for row in read_tsv(out / "tests.tsv", 4)}
    # every pytest-xdist worker writes the ids it collected: each once, in order
    collected = list(dict.fromkeys(line.strip() for line in (out / "collected.txt").read_text().splitlines()
                                   if line.strip())) if (out / "collected.txt").exists() else []
    names = collected + [name for name in reported if name not in collected]
    counts: dict[str, int] = {}
    lines += ["", "| test | result | s | first error line |", "|---|---|---|---|"]
    for name in names:
        _, outcome, seconds, error = reported.get(name, [name, "timeout", "", "not reached before its part's deadline"])
        counts[outcome] = counts.get(outcome, 0) + 1
        lines.append(f"| {cell(name.split('::', 1)[-1])} | {cell(outcome)} | {cell(seconds)} | {cell(error)} |")
    lines += ["", "tests: " + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none reported")]
    # each figure once: a caller that tees the whole check into OUT/*.log holds every HEADLINE twice
    figures = list(dict.fromkeys(parsed for log in sorted(out.glob("*.log"))
                                 for line in log.read_text(errors="replace").splitlines() if (parsed := parse(line))))
    lines += ["", "| benchmark figure | value | goal |", "|---|---|---|"]
    lines += [f"| {cell(what)} | {cell(value)} {unit} | {cell(goal)} |" for what, value, unit, goal in figures]
    if not figures:
        lines.append("| (none measured) | - | - |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        raise SystemExit("usage: python scripts/gpu_check_summary.py OUT (the check's output folder)")
    print(summary(Path(sys.argv[1])), end="")


if __name__ == "__main__":
    main()
