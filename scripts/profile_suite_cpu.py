"""Where a command's CPU time goes, by kind of process: run it (default ``make test``) while sampling
every process's user + system time from ``/proc`` twice a second, then print the seconds per kind
(the tests' zygote and the recipe runs forked from it, pytest workers, data_pipeline, cold recipe
starts, multiprocessing ranks, Ray, ...).

    python scripts/profile_suite_cpu.py                     # make test, then the table
    python scripts/profile_suite_cpu.py -- .venv/bin/python -m pytest -q tests/unit/optim/test_muon.py

On two cores the suite is CPU-bound (its wall time is about its CPU time / 2), so this table, not
the per-test durations (which include waiting for a core), says what a cut would save. Linux only;
processes shorter than the sampling interval are missed, processes alive before the command started
are left out.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(pid: str) -> tuple[tuple[int, int], float] | None:
    """((pid, start time), CPU seconds) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(pid), int(fields[19])), (int(fields[11]) + int(fields[12])) / TICK


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kind(cmd: str) -> str:
    """A process's kind, from its command line."""
    rules = (("_zygote.py", "tests' zygote and the runs forked from it"), ("execnet", "pytest workers (in-process tests)"),
             ("-c import sys;exec(eval(sys.stdin", "pytest workers (in-process tests)"),
             ("multiprocessing", "multiprocessing ranks"), ("train_ddp_process", "ranks Lightning's launcher started"),
             ("torch.distributed.run", "torchrun"), ("data_pipeline", "data_pipeline"),
             ("recipes/reproduce.py", "make reproduce's runner (cold)"), ("ray", "Ray"), ("pip", "pip"))
    for needle, name in rules:
        if needle in cmd:
            return name
    recipe = re.search(r"recipes/(\w+)\.py", cmd)
    if recipe:
        return f"recipe {recipe.group(1)} (cold start)"
    return "other: " + (cmd.split(" ")[0][-40:] or "?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="*", default=["make", "test"])
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    before = {key for key, _ in filter(None, (_read(p) for p in os.listdir("/proc") if p.isdigit()))}
    seen: dict[tuple[int, int], list] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in os.listdir("/proc"):
                if pid.isdigit() and (read := _read(pid)) is not None and read[0] not in before:
                    key, cpu = read
                    if key not in seen:
                        seen[key] = [cpu, _cmdline(key[0])]
                    seen[key][0] = cpu
            done.wait(args.interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    code = subprocess.call(args.command)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    seconds, count = Counter(), Counter()
    for cpu, cmd in seen.values():
        seconds[kind(cmd)] += cpu
        count[kind(cmd)] += 1
    print(f"\n{' '.join(args.command)}: exit {code}, {wall:.0f} s wall, {sum(seconds.values()):.0f} CPU-s "
          f"in {len(seen)} processes on {os.cpu_count()} cores")
    for name, cpu in seconds.most_common():
        print(f"{cpu:9.1f} CPU-s {count[name]:5d}  {name}")
    return code


if __name__ == "__main__":
    sys.exit(main())
