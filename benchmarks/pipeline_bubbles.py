"""Pipeline bubble fraction of each ``torch.distributed.pipelining`` schedule we support, measured
next to the closed-form formula (and a replay of torch's own action order).

    .venv/bin/python -m benchmarks.pipeline_bubbles [--quick] [--fwd-ms 20] [--bwd-ms 40] [--steps 5]

``--quick``: pp=2, m in {4, 8} (~30 s). Default: pp in {2, 4}, m in {4, 8, 16} (~3 minutes).

What runs. Real schedules (GPipe, 1F1B, Interleaved1F1B with v=2 stages per rank, DualPipeV), built
as :mod:`dsl_lit.parallel.pipeline` builds them (``scale_grads=False``, a simple MSE ``loss_fn``,
stages placed by :func:`~dsl_lit.parallel.pipeline.stages_of_rank`), on ``pp`` processes over a
real gloo group (``torch.multiprocessing`` spawn, file:// store, ``torch.set_num_threads(1)``).
A 2-core machine cannot run 4 ranks of real compute without contention, so compute is modelled by
sleeps: each stage chunk is a tiny (1 x 8) activation times a small ``nn.Parameter``, then an
autograd Function that sleeps in forward and in backward. A *rank* spends F (default 20 ms) forward
and B (default 40 ms) backward per micro-batch; a rank holding two stage chunks (Interleaved1F1B,
DualPipeV) spends f = F/2 and b = B/2 in each, so every schedule does the same work, m (F + B) per
rank per step.

What is measured, per (schedule, pp, m). One warm-up step first (it carries the schedules' shape /
metadata inference pass, which runs the stages once more), then ``--steps`` timed steps, each after
a barrier. Per step: T = the slowest rank's wall time of ``schedule.step`` (the pipeline's makespan,
which the optimizer step after it waits for; a rank that finishes early is idle until then), and
busy_r = the sleep time rank r actually executed (timed inside the Function, so oversleep counts as
work, not bubble). A rank's bubble fraction is 1 - busy_r / T, its median over the timed steps; the
table's "measured" is the **mean over ranks**, "max" the worst rank (every rank does the same work,
so they differ only by noise). "cpu ms" is a rank's process CPU time per step (mean over ranks): the
schedule's own Python / autograd / gloo work, since the sleeps cost no CPU.

Units of the formulas. Bubble = idle time of one rank within the step; fraction = bubble / (bubble +
busy) with busy = m (F + B). F, B: a rank's whole per-micro-batch forward and backward times; f, b:
one stage chunk's (F/v, B/v with v chunks per rank). W is the "backward for weights" part of b:
W = 0 here, because all the sleep sits on the activation path (the weight gradient is one multiply),
so a split backward's input half carries all of b. (One torch detail: a *stage 0* BACKWARD_INPUT
does nothing, stage 0 having no input gradient to send, and its whole backward runs in its
BACKWARD_WEIGHT; this only moves rank 0's stage-0 backwards in DualPipeV's zero-bubble tail.)

- GPipe, 1F1B: bubble (pp-1)(F+B), fraction (pp-1) / (m + pp-1).
- Interleaved1F1B, v = 2 chunks per rank: bubble (pp-1)(F+B)/v, fraction (pp-1) / (v m + pp-1).
- DualPipeV: the DualPipe README gives (PP/2-1)(F&B + B - 3W) per device for DualPipe and the same
  for DualPipeV ("cut-in-half" DualPipe), with PP the number of *stages* (2 pp here, on pp ranks),
  F, B, W the times of one stage chunk (our f, b, W) and F&B the time of an overlapped
  forward+backward chunk pair. Torch runs an OVERLAP_F_B action's forward and backward one after
  the other (no custom overlap function is registered, and nothing overlaps on CPU), so F&B = f + b
  and, with W = 0: bubble (pp-1)(f + 2b) = (pp-1)(F + 2B)/2 (= 5/6 of 1F1B's with B = 2F);
  fraction = bubble / (bubble + m (F + B)). Torch needs m >= 2 pp.

"sim" replays torch's own per-rank action order (``pipeline_order`` of Interleaved1F1B and
DualPipeV; the order of GPipe's and 1F1B's hand-written ``_step_microbatches`` loops, not 1F1B's
``_get_pipeline_order()``, which in torch 2.13 skips micro-batch 0's forward on the last rank) with
these chunk times, each action waiting for its producer, and free, instant communication. Where sim
differs from the formula, the schedule's order is the cause; where measured differs from sim, the
runtime is.

Reading the results.

- sim = formula exactly for GPipe, 1F1B and Interleaved1F1B: torch's orders are the textbook ones.
- DualPipeV: sim is *below* the README formula (pp=2: bubble 30 ms = (pp-1)(f+b) instead of 50 ms;
  pp=4: 110 ms instead of 150 ms). Replaying the same order with each OVERLAP_F_B pair as one atomic
  cell that starts when both halves' inputs are ready reproduces the README bubble exactly when
  f = b (pp = 2, 4, 8; and is 10 ms = f below it with b = 2f): the formula assumes truly overlapped
  pairs. Run sequentially, the pair's forward starts without waiting for the backward's gradient,
  which shortens the bubble; on a GPU with a real overlap the formula is the relevant one.
- measured > sim everywhere, by 20-270 ms a step. That is runtime cost on the critical path: each
  action costs ~1-2 ms of CPU (cpu ms / actions per rank, 2 v m actions), and each cross-rank
  hand-off pays gloo's wake-up latency (1-2 ms one-way while these tables were taken; 0.08 ms in a
  quieter moment, when a ``--quick`` run still measured 12-58 ms over sim: the per-action CPU cost
  dominates). With perfectly balanced stages every hand-off is just in time, so these costs add up
  along a critical path of ~2 (v m + pp - 1) actions instead of hiding in slack. The excess thus
  grows with m while the formula's bubble shrinks as 1/m, hence meas/form growing with m, and it is
  largest for the schedules with twice the actions of half the size (Interleaved1F1B, DualPipeV).
  With 5x longer sleeps (second table) the same ~20-100 ms matter 5x less and measured comes to
  within 0.01-0.05 of sim (DualPipeV then measures below its README formula, as sim predicts). The
  ordering by sim (Interleaved1F1B <= DualPipeV < 1F1B = GPipe) is what the formulas predict; at
  the default 20/40 ms the runtime overhead erodes the two-chunk schedules' advantage (at pp=2,
  m=16 they measure worse than 1F1B).

Measured on 2026-11-22, 2-core CPU, gloo, torch 2.13 CPU; the machine was shared with another
session's test suite (1-minute load average 3.4 to 5.3 during the run), which inflates gloo latency
and the measured column. Default run (F=20 ms, B=40 ms, 5 timed steps, 159 s):

    schedule         pp   m  step s  sim s cpu ms  measured    max    sim  formula  meas/form
    -----------------------------------------------------------------------------------------
    pp=2: gloo one-way latency 1.96 ms (tiny tensor, ranks 0-1)
    GPipe             2   4   0.319  0.300      9     0.240  0.242  0.200    0.200       1.20
    GPipe             2   8   0.583  0.540     23     0.169  0.170  0.111    0.111       1.52
    GPipe             2  16   1.146  1.020     57     0.122  0.126  0.059    0.059       2.08
    1F1B              2   4   0.318  0.300      9     0.234  0.235  0.200    0.200       1.17
    1F1B              2   8   0.584  0.540     19     0.156  0.157  0.111    0.111       1.40
    1F1B              2  16   1.084  1.020     36     0.104  0.104  0.059    0.059       1.77
    Interleaved1F1B   2   4   0.303  0.270     21     0.198  0.200  0.111    0.111       1.78
    Interleaved1F1B   2   8   0.568  0.510     43     0.140  0.141  0.059    0.059       2.38
    Interleaved1F1B   2  16   1.101  0.990     83     0.113  0.117  0.030    0.030       3.72
    DualPipeV         2   4   0.301  0.270     17     0.195  0.197  0.111    0.172       1.13
    DualPipeV         2   8   0.581  0.510     35     0.154  0.154  0.059    0.094       1.63
    DualPipeV         2  16   1.151  0.990     70     0.141  0.144  0.030    0.050       2.84
    pp=4: gloo one-way latency 1.97 ms (tiny tensor, ranks 0-1)
    GPipe             4   4   0.469  0.420     13     0.479  0.482  0.429    0.429       1.12
    GPipe             4   8   0.726  0.660     23     0.333  0.335  0.273    0.273       1.22
    GPipe             4  16   1.257  1.140     45     0.229  0.231  0.158    0.158       1.45
    1F1B              4   4   0.457  0.420     11     0.468  0.470  0.429    0.429       1.09
    1F1B              4   8   0.741  0.660     22     0.332  0.340  0.273    0.273       1.22
    1F1B              4  16   1.384  1.140     56     0.272  0.285  0.158    0.158       1.72
    Interleaved1F1B   4   4   0.431  0.330     29     0.404  0.419  0.273    0.273       1.48
    Interleaved1F1B   4   8   0.839  0.570     60     0.331  0.348  0.158    0.158       2.09
    Interleaved1F1B   4  16   1.322  1.050    105     0.214  0.225  0.086    0.086       2.49
    DualPipeV         4   4  n/a: DualPipeV needs m >= 2 pp (8)
    DualPipeV         4   8   0.693  0.590     39     0.295  0.300  0.186    0.238       1.24
    DualPipeV         4  16   1.231  1.070     76     0.208  0.212  0.103    0.135       1.54

``--quick --fwd-ms 100 --bwd-ms 200 --steps 3`` (same day and machine, 81 s):

    schedule         pp   m  step s  sim s cpu ms  measured    max    sim  formula  meas/form
    -----------------------------------------------------------------------------------------
    pp=2: gloo one-way latency 1.08 ms (tiny tensor, ranks 0-1)
    GPipe             2   4   1.537  1.500     22     0.208  0.208  0.200    0.200       1.04
    GPipe             2   8   2.738  2.700     28     0.121  0.122  0.111    0.111       1.09
    1F1B              2   4   1.516  1.500     12     0.207  0.207  0.200    0.200       1.04
    1F1B              2   8   2.728  2.700     26     0.119  0.119  0.111    0.111       1.07
    Interleaved1F1B   2   4   1.431  1.350     32     0.133  0.142  0.111    0.111       1.19
    Interleaved1F1B   2   8   2.626  2.550     51     0.078  0.079  0.059    0.059       1.33
    DualPipeV         2   4   1.430  1.350     21     0.155  0.155  0.111    0.172       0.90
    DualPipeV         2   8   2.650  2.550     39     0.091  0.091  0.059    0.094       0.96
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from dsl_lit.parallel.pipeline import MULTI_STAGE, SCHEDULES, stages_of_rank

WIDTH = 8  # features of the tiny activations


class Clock:
    """Sleeps and sums the seconds actually slept (this rank's busy time)."""

    def __init__(self) -> None:
        self.busy = 0.0

    def sleep(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - start


class _Sleep(torch.autograd.Function):
    """Identity on the activations that sleeps ``fwd_s`` in forward and ``bwd_s`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: Clock, fwd_s: float, bwd_s: float) -> torch.Tensor:
        clock.sleep(fwd_s)
        ctx.clock, ctx.bwd_s = clock, bwd_s
        return x.clone()  # a stage output of its own (schedules detach_() outputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.clock.sleep(ctx.bwd_s)
        return grad, None, None, None


class SleepStage(nn.Module):
    """One stage chunk: ``x * weight`` (so the stage has weights and a weight gradient), then sleeps."""

    def __init__(self, clock: Clock, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))
        self.clock, self.fwd_s, self.bwd_s = clock, fwd_s, bwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.weight, self.clock, self.fwd_s, self.bwd_s)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def chunks_per_rank(schedule: str) -> int:
    return 2 if schedule in MULTI_STAGE else 1


def valid(schedule: str, pp: int, m: int) -> str | None:
    """Why torch refuses (schedule, pp, m), or None."""
    if schedule == "1F1B" and m < pp:
        return f"1F1B needs m >= pp ({pp})"
    if schedule == "DualPipeV" and m < 2 * pp:
        return f"DualPipeV needs m >= 2 pp ({2 * pp})"
    if schedule == "Interleaved1F1B" and m % max(1, m // pp):
        return "Interleaved1F1B needs m a multiple of its rounds"
    return None


def single_stage_order(schedule: str, pp: int, m: int) -> dict[int, list]:
    """The per-rank order of torch's hand-written GPipe and 1F1B loops (``_step_microbatches``).

    Not their ``_get_pipeline_order()``: in torch 2.13 the 1F1B one skips micro-batch 0's forward
    on the last rank."""
    order = {}
    for r in range(pp):
        if schedule == "GPipe":
            actions = [["F", r, i, None] for i in range(m)] + [["B", r, i, None] for i in range(m)]
        else:  # 1F1B: min(m, pp - r) warm-up forwards, then one backward and one forward, then backwards
            warmup = min(m, pp - r)
            actions = [["F", r, i, None] for i in range(warmup)]
            for i in range(m):
                actions.append(["B", r, i, None])
                if warmup + i < m:
                    actions.append(["F", r, warmup + i, None])
        order[r] = actions
    return order


def _serialise_order(order: dict[int, list]) -> dict[int, list]:
    """torch's per-rank compute actions as JSON-able (type, stage, micro-batch, sub-actions)."""

    def one(a):
        subs = [one(s) for s in a.sub_actions] if getattr(a, "sub_actions", None) else None
        return [str(a.computation_type.value), a.stage_index, a.microbatch_index, subs]

    return {rank: [one(a) for a in actions if a is not None] for rank, actions in order.items()}


def _run_case(schedule: str, pp: int, m: int, fwd_s: float, bwd_s: float, steps: int) -> dict:
    rank = dist.get_rank()
    v = chunks_per_rank(schedule)
    clock = Clock()
    owned = stages_of_rank(rank, pp, v, schedule)
    stages = [
        PipelineStage(SleepStage(clock, fwd_s / v, bwd_s / v), s, pp * v, torch.device("cpu")) for s in owned
    ]
    cls = SCHEDULES[schedule]
    sched = cls(stages if schedule in MULTI_STAGE else stages[0], n_microbatches=m, loss_fn=_mse, scale_grads=False)
    holds_first, holds_last = 0 in owned, pp * v - 1 in owned
    x, target = torch.randn(m, WIDTH), torch.randn(m, WIDTH)
    walls, busys, cpus = [], [], []
    for step in range(1 + steps):  # step 0 warms up: it includes the shape/metadata inference pass
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        dist.barrier()
        clock.busy = 0.0
        start, cpu = time.perf_counter(), time.process_time()
        sched.step(*((x,) if holds_first else ()), target=target if holds_last else None, return_outputs=False)
        if step:
            walls.append(time.perf_counter() - start)
            busys.append(clock.busy)
            cpus.append(time.process_time() - cpu)
    order = _serialise_order(sched.pipeline_order) if rank == 0 and schedule in MULTI_STAGE else None
    return {"walls": walls, "busys": busys, "cpus": cpus, "order": order}


def _p2p_latency(rounds: int = 50) -> float:
    """Median one-way latency of a tiny gloo send/recv between ranks 0 and 1 (half a round trip)."""
    buf, times = torch.zeros(WIDTH), []
    for _ in range(rounds + 5):
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[5:])


def _worker(rank: int, pp: int, init_file: str, cases: list, fwd_s: float, bwd_s: float, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp)
    results = [{"latency": _p2p_latency()}]
    for schedule, m in cases:
        mine = _run_case(schedule, pp, m, fwd_s, bwd_s, steps)
        gathered: list = [None] * pp
        dist.all_gather_object(gathered, mine)
        results.append({"schedule": schedule, "pp": pp, "m": m, "ranks": gathered})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def simulate(order: dict, pp: int, v: int, fwd_s: float, bwd_s: float) -> float:
    """Makespan of torch's action order with chunk times f = F/v, b = B/v, W = 0 (all of a stage-0
    backward in its W when torch splits it) and free, instant communication."""
    f, b = fwd_s / v, bwd_s / v
    last = pp * v - 1
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "I", stage, mb) -> end time

    def cost_and_deps(kind: str, s: int, i: int) -> tuple[float, list, str | None]:
        if kind == "F":
            return f, ([("F", s - 1, i)] if s else []), "F"
        if kind in ("B", "I"):  # full backward or backward-input: needs the next stage's input grad
            deps = [("F", s, i)] + ([("I", s + 1, i)] if s < last else [])
            return (b if kind == "B" or s else 0.0), deps, "I"
        if kind == "W":
            return (b if s == 0 else 0.0), [], None
        return 0.0, [], None  # REDUCE_GRAD and the like

    flat = {int(r): [] for r in order}
    for r, actions in order.items():
        for kind, s, i, subs in actions:
            for k, s2, i2, _ in subs or [[kind, s, i, None]]:
                flat[int(r)].append((k, s2, i2))
    pos, clock = dict.fromkeys(flat, 0), dict.fromkeys(flat, 0.0)
    while any(pos[r] < len(flat[r]) for r in flat):
        progressed = False
        for r in flat:
            while pos[r] < len(flat[r]):
                kind, s, i = flat[r][pos[r]]
                cost, deps, marks = cost_and_deps(kind, s, i)
                if any(d not in done for d in deps):
                    break
                end = max([clock[r], *(done[d] for d in deps)]) + cost
                clock[r] = end
                if marks:
                    done[(marks, s, i)] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule order deadlocks in the simulation")
    return max(clock.values())


def formula(schedule: str, pp: int, m: int, fwd_s: float, bwd_s: float) -> float:
    """Closed-form bubble fraction (see the module docstring for units and assumptions)."""
    busy = m * (fwd_s + bwd_s)
    if schedule in ("GPipe", "1F1B"):
        bubble = (pp - 1) * (fwd_s + bwd_s)
    elif schedule == "Interleaved1F1B":
        bubble = (pp - 1) * (fwd_s + bwd_s) / 2
    else:  # DualPipeV: (PP/2 - 1)(F&B + b - 3W), PP = 2 pp stages, F&B = f + b, W = 0
        f, b = fwd_s / 2, bwd_s / 2
        bubble = (pp - 1) * (f + 2 * b)
    return bubble / (bubble + busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pp=2, m in {4, 8} only")
    parser.add_argument("--fwd-ms", type=float, default=20.0, help="forward time per rank per micro-batch")
    parser.add_argument("--bwd-ms", type=float, default=40.0, help="backward time per rank per micro-batch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up step")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    args = parser.parse_args()
    pps, ms = ([2], [4, 8]) if args.quick else ([2, 4], [4, 8, 16])
    fwd_s, bwd_s = args.fwd_ms / 1e3, args.bwd_ms / 1e3
    print(f"cpu cores={os.cpu_count()} gloo, F={args.fwd_ms:g} ms B={args.bwd_ms:g} ms per rank per micro-batch "
          f"(halved per chunk with 2 chunks per rank), {args.steps} timed steps after 1 warm-up")
    print("step s: slowest rank's schedule.step (median); sim s: torch's action order with free communication; "
          "cpu ms: a rank's CPU time per step (the sleeps cost none); measured: mean over ranks of "
          "1 - busy / step s (median over steps); max: worst rank; sim: 1 - busy / sim s")
    header = (f"{'schedule':<16}{'pp':>3}{'m':>4}{'step s':>8}{'sim s':>7}{'cpu ms':>7}{'measured':>10}{'max':>7}{'sim':>7}"
              f"{'formula':>9}{'meas/form':>11}")
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    for pp in pps:
        cases = [(schedule, m) for schedule in args.schedules for m in ms if not valid(schedule, pp, m)]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.json")
            mp.spawn(_worker, args=(pp, os.path.join(tmp, "init"), cases, fwd_s, bwd_s, args.steps, out),
                     nprocs=pp, join=True)
            latency, *results = json.loads(Path(out).read_text())
        print(f"pp={pp}: gloo one-way latency {latency['latency'] * 1e3:.2f} ms (tiny tensor, ranks 0-1)")
        by_case = {(r["schedule"], r["m"]): r for r in results}
        for schedule in args.schedules:
            for m in ms:
                if (schedule, m) not in by_case:
                    print(f"{schedule:<16}{pp:>3}{m:>4}  n/a: {valid(schedule, pp, m)}")
                    continue
                ranks = by_case[(schedule, m)]["ranks"]
                steps = len(ranks[0]["walls"])
                makespans = [max(r["walls"][k] for r in ranks) for k in range(steps)]
                per_rank = [statistics.median(1 - r["busys"][k] / makespans[k] for k in range(steps)) for r in ranks]
                measured, worst = statistics.mean(per_rank), max(per_rank)
                cpu_ms = 1e3 * statistics.mean(statistics.median(r["cpus"]) for r in ranks)
                v = chunks_per_rank(schedule)
                order = ranks[0]["order"] or single_stage_order(schedule, pp, m)
                span = simulate(order, pp, v, fwd_s, bwd_s)
                sim = 1 - m * (fwd_s + bwd_s) / span
                form = formula(schedule, pp, m, fwd_s, bwd_s)
                print(f"{schedule:<16}{pp:>3}{m:>4}{statistics.median(makespans):>8.3f}{span:>7.3f}{cpu_ms:>7.0f}{measured:>10.3f}"
                      f"{worst:>7.3f}{sim:>7.3f}{form:>9.3f}{measured / form:>11.2f}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
