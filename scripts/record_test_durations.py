"""Record each test file's seconds from a pytest JUnit report into ``tests/durations.json``, which
``make test``'s scheduler reads to hand out the longest files first.

    .venv/bin/python -m pytest ... --junitxml=/tmp/suite.xml && python scripts/record_test_durations.py /tmp/suite.xml

Per file: the sum of its test cases' times (setup and teardown included, as pytest reports them) in
that run; files the report lacks keep their recorded value, files that no longer exist are dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"


def file_seconds(report: Path) -> dict[str, float]:
    """Seconds per test file (path relative to the repository, as ``tests/x/test_y.py``)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is the dotted module path, then the class when there is one
        while module and not (ROOT / Path(*module)).with_suffix(".py").is_file():
            module = module[:-1]
        if module:
            seconds[str(Path(*module).with_suffix(".py"))] += float(case.get("time") or 0)
    return dict(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a pytest --junitxml report of the whole suite")
    args = parser.parse_args()
    if not args.report.is_file():
        print(f"record_test_durations: {args.report} is not a file (run pytest with --junitxml={args.report})", file=sys.stderr)
        return 2
    measured = file_seconds(args.report)
    if not measured:
        print(f"record_test_durations: {args.report} holds no test case of this repository's tests", file=sys.stderr)
        return 2
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    merged = {path: seconds for path, seconds in {**recorded, **measured}.items() if (ROOT / path).is_file()}
    ordered = dict(sorted(((p, round(s, 1)) for p, s in merged.items()), key=lambda kv: (-kv[1], kv[0])))
    DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{DURATIONS.relative_to(ROOT)}: {len(ordered)} files, {sum(ordered.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
