"""The default executor: units in this process, or in a pool of ``num_proc`` processes.

Why spawn, not fork: a forked child inherits thread pools (tokenizers, BLAS) mid-state. The pool
is started on the first step with more than one unit to run, so a resumed run whose steps are all
done starts no processes.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from data_pipeline.context import Context
from data_pipeline.executors import UnitFn
from data_pipeline.stage import Step


class LocalExecutor:
    def __init__(self, num_proc: int) -> None:
        self.num_proc = num_proc
        self._pool: ProcessPoolExecutor | None = None

    def run(self, fn: UnitFn, step: Step, ctx: Context, units: list[int]) -> None:
        if self.num_proc == 1 or len(units) == 1:
            for unit in units:
                fn(step, ctx, unit)
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.num_proc, mp_context=multiprocessing.get_context("spawn"))
        for future in [self._pool.submit(fn, step, ctx, u) for u in units]:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
