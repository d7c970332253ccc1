"""``stats.json``: documents and bytes in and out, removals by reason, and seconds, per stage.

Why from the markers: every unit recorded its own counts when it finished, so the report of a
resumed run covers the work of every run that contributed, and needs no second pass over the data.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from data_pipeline.io.shards import read_marker, write_json

STATS_FILE = "stats.json"
_COUNTS = ("docs_in", "docs_out", "bytes_in", "bytes_out")
_MEASURED = ("seconds", "peak_rss_mb")  # what the runner adds to every marker: not a step's details


def _stage_stats(steps: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": 0.0, "units": 0, "peak_rss_mb": 0.0}
    removed: Counter[str] = Counter()
    details: dict[str, Any] = {}
    for p in steps:
        markers = [read_marker(p.context.step_dir, u) for u in range(p.num_units)]
        out["seconds"] += sum(m["seconds"] for m in markers)
        out["units"] += len(markers)
        out["peak_rss_mb"] = max([out["peak_rss_mb"], *(m.get("peak_rss_mb", 0.0) for m in markers)])
        if p.step.writes_documents:
            for key in _COUNTS:
                out[key] = sum(m[key] for m in markers)
            for m in markers:
                removed.update(m["removed"])
            if "blank_lines" in markers[0]:
                out["blank_lines_skipped"] = sum(m["blank_lines"] for m in markers)
        elif p.num_units == 1:
            details[p.step.name] = {k: v for k, v in markers[0].items() if k not in _MEASURED}
    out["seconds"] = round(out["seconds"], 3)
    if removed or any(p.step.writes_documents for p in steps):
        out["removed"] = dict(sorted(removed.items()))
    if details:
        out["details"] = details
    return out


def write_stats(cfg: Any, planned: list[Any]) -> dict[str, Any]:
    stages: dict[str, list[Any]] = {}
    for p in planned:
        stages.setdefault(p.step.stage, []).append(p)
    per_stage = {name: _stage_stats(steps) for name, steps in stages.items()}
    doc_stages = [s for s in per_stage.values() if "docs_in" in s]
    removed_total = sum(sum(s["removed"].values()) for s in doc_stages)
    copies = sum(s["docs_out"] - s["docs_in"] + sum(s["removed"].values()) for s in doc_stages)
    stats = {
        "input": {"documents": doc_stages[0]["docs_in"], "bytes": doc_stages[0]["bytes_in"]},
        "output": {
            "documents": doc_stages[-1]["docs_out"],
            "bytes": doc_stages[-1]["bytes_out"],
            "removed": removed_total,
            "extra_copies": copies,
        },
        "stages": per_stage,
        "seconds": round(sum(s["seconds"] for s in per_stage.values()), 3),
    }
    write_json(stats, Path(cfg.output_dir) / STATS_FILE)
    return stats
