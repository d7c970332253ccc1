"""A stage's several recipe runs (the ablations' seeds), two at a time on two cores: both run at
once, each on its share of the threads with its own log; a failure stops the rest and names its log."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from dsl_lit.config.reproduce import ReproduceConfig
from dsl_lit.reproduce.runner import StageContext, StageFailed

CHILD = """
import json, os, sys, time
import torch
start = time.time()
time.sleep(float(sys.argv[2]))
with open(sys.argv[1], "w") as out:
    json.dump({"start": start, "end": time.time(), "threads": os.environ.get("OMP_NUM_THREADS"),
               "torch_threads": torch.get_num_threads()}, out)
sys.exit(int(sys.argv[3]))
"""


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_runs_go_two_at_a_time_each_on_its_share_of_the_cores(tmp_path: Path, fork: bool) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    cfg = ReproduceConfig(device="cpu" if fork else "cuda")
    ctx = StageContext(cfg, tmp_path, "ablations")
    outs = [tmp_path / f"run{i}.json" for i in range(3)]
    logs = [tmp_path / f"run{i}.log" for i in range(3)]
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(3)  # what a fork inherits (the runner imported torch before knowing the share)
    try:
        ctx.run_all([[str(script), str(out), "0.6", "0"] for out in outs], concurrent=2, log_paths=logs)
    finally:
        torch.set_num_threads(before)
    runs = [json.loads(out.read_text()) for out in outs]
    assert runs[0]["start"] < runs[1]["end"] and runs[1]["start"] < runs[0]["end"]  # the first two overlap
    assert runs[2]["start"] >= min(runs[0]["end"], runs[1]["end"]) - 0.05  # the third waits for a free slot
    share = max(1, (os.cpu_count() or 1) // 2)
    assert {r["threads"] for r in runs} == {str(share)}
    # torch's own count too: a fork inherits torch imported with every core's threads (the runner's
    # preload), where the variable alone is read too late; without set_num_threads both ran 2 on 2 cores
    assert {r["torch_threads"] for r in runs} == {share}
    assert all(log.read_text().startswith("\n$ ") for log in logs) and len(ctx.commands) == 3


def test_a_failure_stops_the_others_and_names_its_log(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    ctx = StageContext(ReproduceConfig(device="cpu"), tmp_path, "ablations")
    logs = [tmp_path / "slow.log", tmp_path / "bad.log", tmp_path / "never.log"]
    began = time.monotonic()
    with pytest.raises(StageFailed, match=r"child.py exited 3; log .*bad.log"):
        ctx.run_all([[str(script), str(tmp_path / "slow.json"), "30", "0"],
                     [str(script), str(tmp_path / "bad.json"), "0.2", "3"],
                     [str(script), str(tmp_path / "never.json"), "0", "0"]], concurrent=2, log_paths=logs)
    assert time.monotonic() - began < 15  # the 30-second run was stopped
    assert not (tmp_path / "never.json").exists() and not logs[2].exists()
