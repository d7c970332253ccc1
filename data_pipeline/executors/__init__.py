"""Where a step's units run: this machine (in process or a process pool) or a Ray cluster.

Why a seam of its own: the runner decides which units a step still lacks (by their markers) and
keeps the steps in order; an executor only runs a list of independent units of one step and
returns once each has its marker, or raises. Every executor calls the same ``run_unit``, which
writes the same files and the same marker, so the outputs are byte-identical whichever ran them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from data_contract.errors import ConfigError

if TYPE_CHECKING:
    from data_pipeline.context import Context
    from data_pipeline.stage import Step

UnitFn = Callable[["Step", "Context", int], dict[str, Any]]
"""``run_unit(step, ctx, unit)``: computes one unit and writes its marker (data_pipeline.runner)."""

KINDS = ("local", "ray")


@dataclass
class ExecutorConfig:
    kind: str = "local"  # local: num_proc processes on this machine | ray: tasks on a Ray cluster
    address: str = "auto"
    """ray: ``auto`` (RAY_ADDRESS, else the cluster ``ray start`` joined this machine to) or
    ``<host>:<port>`` of the head node."""
    max_retries: int = 3
    """ray: reruns of a unit whose worker process or node died, or that raised an OSError (a
    flaky shared filesystem); a unit's outputs are written atomically, so a rerun starts clean."""
    num_cpus: float = 1.0  # ray: CPUs a unit reserves (units of a step run as widely as the cluster allows)
    connect_timeout_s: float = 10.0
    """ray: how long a named head (``<host>:<port>``) may take to answer the gRPC handshake."""

    def validate(self) -> ExecutorConfig:
        if self.kind not in KINDS:
            raise ConfigError(
                f"executor.kind={self.kind!r} must be one of {list(KINDS)} (executor=ray on the command line)"
            )
        if not self.address:
            raise ConfigError("executor.address is empty: give auto or <host>:<port> of the Ray head")
        if self.max_retries < 0:
            raise ConfigError(f"executor.max_retries={self.max_retries} must be >= 0")
        if self.num_cpus <= 0:
            raise ConfigError(f"executor.num_cpus={self.num_cpus} must be positive")
        if not self.connect_timeout_s > 0:
            raise ConfigError(f"executor.connect_timeout_s={self.connect_timeout_s} must be > 0 (seconds)")
        return self


class Executor(Protocol):
    def run(self, fn: UnitFn, step: Step, ctx: Context, units: list[int]) -> None:
        """Run ``fn(step, ctx, u)`` for every ``u`` in ``units``; raise if one fails for good."""

    def close(self) -> None:
        """Release processes or the cluster connection this executor opened."""


def make_executor(cfg: ExecutorConfig, num_proc: int) -> Executor:
    """The executor ``cfg`` names (connecting to the cluster for ``ray``); ``num_proc``: the local
    executor's worker processes."""
    if cfg.kind == "ray":
        from data_pipeline.executors.ray_tasks import RayExecutor

        return RayExecutor(cfg)
    from data_pipeline.executors.local import LocalExecutor

    return LocalExecutor(num_proc)
