"""Stages that do not need each other run at once (dsl_lit.reproduce.runner): each starts once what
it needs has finished, the report after every other; their recipe runs share the preset's core
slots (never more runs than slots, each on cores / slots threads), a free slot going to the stage
the most others wait on. A failing stage stops the rest and names its log; a stage's ConfigError is
one. Each case runs in a fresh single-threaded interpreter (a pytest-xdist worker has threads, where
the runner would run the stages one by one in its own process)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsl_lit.reproduce.core_slots import CoreSlots
from tests.conftest import ROOT

CHILD = """
import json, os, sys, time
start = time.time()
time.sleep(float(sys.argv[2]))
with open(sys.argv[1], "w") as out:
    json.dump({"start": start, "end": time.time(), "threads": os.environ.get("OMP_NUM_THREADS")}, out)
sys.exit(int(sys.argv[3]))
"""

SCENARIO = """
import json, os, sys
from pathlib import Path
from data_contract.errors import ConfigError
from dsl_lit.config.reproduce import ReproduceConfig
from dsl_lit.config.reproduce_stages import StageRow
from dsl_lit.reproduce.runner import Stage, StageFailed, run_stages

child, run_dir, plan = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])

def work(name, seconds, runs, code):
    def run(ctx):
        if code == "config":
            raise ConfigError(f"stage {name}: a bad setting")
        outs = [ctx.dir / f"run{k}.json" for k in range(runs)]
        ctx.run_all([[str(child), str(out), str(seconds), str(code)] for out in outs], concurrent=runs,
                    log_paths=[ctx.dir / f"run{k}.log" for k in range(runs)])
        return {"runs": [json.loads(out.read_text()) for out in outs]}
    return run

stages = [Stage.from_row(StageRow(s["name"], tuple(s["needs"]), s["name"], s["name"], redrawn=s.get("redrawn", False)),
                         work(s["name"], s["seconds"], s["runs"], s.get("code", 0))) for s in plan]
lines = []
try:
    results = run_stages(ReproduceConfig(device="cuda", concurrent_runs=2), stages, run_dir, progress=lines.append)
    print(json.dumps({"results": results, "lines": lines}))
except (StageFailed, ConfigError) as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error), "lines": lines}))
"""

# a chain (a, then b and x, then c) beside a leaf stage whose runs would keep a slot busy to its end,
# and the report last
PLAN = [
    {"name": "a", "needs": [], "seconds": 1.0, "runs": 1},
    {"name": "leaf", "needs": [], "seconds": 0.6, "runs": 4},
    {"name": "b", "needs": ["a"], "seconds": 1.0, "runs": 1},
    {"name": "x", "needs": ["a"], "seconds": 1.0, "runs": 1},
    {"name": "c", "needs": ["b", "x"], "seconds": 0.2, "runs": 1},
    {"name": "report", "needs": [], "seconds": 0.1, "runs": 1, "redrawn": True},
]


def _scenario(tmp_path: Path, plan: list[dict]) -> dict:
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(CHILD))
    result = subprocess.run([sys.executable, "-c", SCENARIO, str(child), str(tmp_path / "run"), json.dumps(plan)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_independent_stages_overlap_on_the_slots_and_the_chain_goes_first(tmp_path: Path) -> None:
    outcome = _scenario(tmp_path, PLAN)
    runs = {name: r["runs"] for name, r in outcome["results"].items()}
    a, b, x, c, report = (runs[name][0] for name in ("a", "b", "x", "c", "report"))
    leaf = sorted(r["start"] for r in runs["leaf"])
    everything = [run for stage in runs.values() for run in stage]
    # never more runs at once than slots (two): at any run's start, at most one other is running
    for run in everything:
        assert sum(other["start"] <= run["start"] < other["end"] for other in everything if other is not run) <= 1
    assert leaf[0] < a["end"]  # the leaf overlaps the chain
    assert min(b["start"], x["start"]) >= a["end"] - 0.05 and c["start"] >= max(b["end"], x["end"]) - 0.05  # needs
    # b and x outrank the leaf (c waits on them): one takes the slot a's end frees (claimed before it
    # came back, so the leaf's waiting run cannot slip in), the other the leaf's slot at its next run's
    # end; without priorities one would wait for the leaf's four runs
    assert max(b["start"], x["start"]) < leaf[2]
    assert report["start"] >= max(r["end"] for r in everything if r is not report) - 0.05  # the report last
    share = str(max(1, (os.cpu_count() or 1) // 2))
    assert {r["threads"] for r in everything} == {share}
    done = [json.loads((tmp_path / "run" / name / "DONE.json").read_text()) for name in runs]
    assert all(m["started_at"] <= m["finished_at"] for m in done)
    started = [line.split(":")[0] for line in outcome["lines"] if "elapsed" in line]
    assert started == ["stage 1/6 a", "stage 2/6 leaf", "stage 3/6 b", "stage 4/6 x", "stage 5/6 c", "stage 6/6 report"]
    assert outcome["lines"][-1].startswith("all 6 stages finished in")


def test_a_failing_stage_stops_the_others_which_keep_no_marker(tmp_path: Path) -> None:
    plan = [{"name": "slow", "needs": [], "seconds": 30, "runs": 1},
            {"name": "bad", "needs": [], "seconds": 0.3, "runs": 1, "code": 3},
            {"name": "after", "needs": ["bad"], "seconds": 0, "runs": 1}]
    began = time.monotonic()
    outcome = _scenario(tmp_path, plan)
    assert time.monotonic() - began < 30  # the 30-second run was stopped
    assert outcome["error"] == "StageFailed"
    assert "stage bad: child.py exited 3; log" in outcome["message"] and "run0.log" in outcome["message"]
    run = tmp_path / "run"
    assert not (run / "slow" / "DONE.json").exists() and not (run / "bad" / "DONE.json").exists()
    assert not (run / "after").exists()  # never started


def test_a_stages_config_error_is_one_line_not_a_stage_failure(tmp_path: Path) -> None:
    outcome = _scenario(tmp_path, [{"name": "broken", "needs": [], "seconds": 0, "runs": 1, "code": "config"}])
    assert outcome == {"error": "ConfigError", "message": "stage broken: a bad setting",
                       "lines": [outcome["lines"][0]]}


def _waiter(slots: CoreSlots, owner: int, priority: int, granted: object) -> None:
    while not slots.try_take(owner, priority):
        time.sleep(0.01)
    granted[owner] = time.monotonic()  # type: ignore[index]
    time.sleep(0.3)
    slots.give_back(owner)


def test_a_free_slot_goes_to_the_highest_waiting_claim_and_an_ended_stages_slot_comes_back() -> None:
    context = multiprocessing.get_context("fork")
    slots = CoreSlots(1, context)
    assert slots.try_take(1, 0) and slots.free == 0 and slots.held(1) == 1
    granted = context.RawArray("d", 4)
    low = context.Process(target=_waiter, args=(slots, 2, 0, granted))
    high = context.Process(target=_waiter, args=(slots, 3, 5, granted))
    low.start()
    time.sleep(0.3)  # the low one waits first
    high.start()
    time.sleep(0.3)
    slots.give_back(1)
    low.join(10)
    high.join(10)
    assert 0 < granted[3] < granted[2]  # the later, higher one first
    assert slots.free == 1
    with pytest.raises(RuntimeError, match="never taken"):
        slots.give_back(1)
    # a claim registered for a stage not started yet keeps a lower one out; its end gives back what it held
    slots.claim(3, 2)
    assert not slots.try_take(4, 1) and slots.try_take(3, 2) and slots.free == 0
    slots.reclaim(3)
    slots.withdraw(4)
    assert slots.free == 1 and slots.held(3) == 0 and slots.try_take(4, 1)
    assert CoreSlots(2).threads() == max(1, (os.cpu_count() or 1) // 2) and CoreSlots(1).threads() is None
