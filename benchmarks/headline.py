"""One line per benchmark result that ``python -m benchmarks`` collects into its table."""

from __future__ import annotations

PREFIX = "HEADLINE"


def headline(what: str, value: float, unit: str, goal: str = "") -> None:
    """Print ``what`` = ``value`` ``unit`` (e.g. "x" for a ratio) and the goal it is held to."""
    print(f"{PREFIX}\t{what}\t{value:.4g}\t{unit}\t{goal}", flush=True)


def parse(line: str) -> tuple[str, str, str, str] | None:
    if not line.startswith(PREFIX + "\t"):
        return None
    what, value, unit, goal = (line.rstrip("\n").split("\t") + [""] * 4)[1:5]
    return what, value, unit, goal
