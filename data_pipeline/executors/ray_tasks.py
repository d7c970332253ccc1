"""``executor=ray``: the units of each step run as Ray tasks on a running cluster.

Why Ray tasks around our own units, not Ray Data: the units, their files and their completion
markers stay the pipeline's, so a step run by Ray, by a local process pool or by a SLURM array
writes the same bytes, and a run interrupted under one executor resumes under another. Ray adds
what one machine lacks: every node's CPUs, and reruns of a unit whose worker or node died
(``executor.max_retries``; its outputs are renamed into place only when complete, so a rerun
starts clean). Every node must see the input and output directories at the same paths (a shared
filesystem) and import the same dsl-lit, as for the array-task path.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from data_pipeline.context import Context
from data_pipeline.executors import ExecutorConfig, UnitFn
from data_pipeline.stage import Step
from dsl_lit.config.errors import ConfigError

log = logging.getLogger(__name__)
_POLL_SECONDS = 1.0
_CONNECT_SECONDS = 5.0


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS
_SETTINGS_FRAME = 4


def _check_reachable(address: str, timeout: float) -> None:
    """A named head must answer before ``ray.init`` is called: ``ray.init`` retries an address that
    is not a Ray head for minutes, deaf to SIGTERM. Ray's head (its GCS) is a gRPC server, so it
    answers HTTP/2's connection preface with a SETTINGS frame; a port where nothing listens, or
    another service, does not within ``timeout`` seconds."""
    if address == "auto":
        return  # Ray finds the local cluster itself, and says so at once when there is none
    host, _, port = address.split("://")[-1].rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    try:
        connection = socket.create_connection((host, int(port)), timeout=min(timeout, _CONNECT_SECONDS))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"executor.address={address}: no Ray head answers there ({e}); give <host>:<port> of a "
            "running head (`ray start --head` prints it), or auto on a node of the cluster"
        ) from e
    try:
        connection.settimeout(timeout)
        connection.sendall(_HTTP2_PREFACE)
        header = b""
        while len(header) < 9:  # a frame header: length (3 bytes), type, flags, stream id
            chunk = connection.recv(9 - len(header))
            if not chunk:
                break
            header += chunk
        answered = len(header) == 9 and header[3] == _SETTINGS_FRAME
    except OSError:  # timed out, or reset
        answered = False
    finally:
        connection.close()
    if not answered:
        raise ConfigError(
            f"executor.address={address}: something listens there but no Ray head answered a gRPC (HTTP/2) "
            f"handshake within executor.connect_timeout_s={timeout:g} s; give <host>:<port> of a running head "
            "(`ray start --head` prints it)"
        )


def _in_directory(cwd: str, fn: UnitFn, step: Step, ctx: Context, unit: int) -> dict[str, Any]:
    """Run the unit from the driver's working directory: relative paths mean the same on every node."""
    os.chdir(cwd)
    return fn(step, ctx, unit)


class RayExecutor:
    def __init__(self, cfg: ExecutorConfig) -> None:
        try:
            import ray
        except ImportError as e:
            raise ConfigError("executor=ray needs Ray: pip install 'dsl-lit[ray]'") from e
        self._ray = ray
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            _check_reachable(cfg.address, cfg.connect_timeout_s)
            try:
                ray.init(address=cfg.address, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise ConfigError(
                    f"executor.address={cfg.address}: no Ray cluster found ({e}); start one with "
                    "`ray start --head` (and `ray start --address=<head>:<port>` on the other nodes), "
                    "or give executor.address=<head>:<port>"
                ) from e
        self.cfg = cfg
        self._task = ray.remote(_in_directory).options(
            num_cpus=cfg.num_cpus,
            max_retries=cfg.max_retries,
            retry_exceptions=[OSError],
            scheduling_strategy="SPREAD",  # units are alike and short-lived: use every node from the start
        )
        self._cwd = os.getcwd()

    def run(self, fn: UnitFn, step: Step, ctx: Context, units: list[int]) -> None:
        ray = self._ray
        ctx_ref = ray.put(ctx)  # one copy in the object store, not one per unit
        pending = {self._task.remote(self._cwd, fn, step, ctx_ref, u): u for u in units}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_POLL_SECONDS)
                for ref in ready:
                    unit = pending.pop(ref)
                    try:
                        ray.get(ref)
                    except Exception:
                        log.error(
                            "%s: unit %d failed on the Ray cluster (after up to %d retries)",
                            step.name,
                            unit,
                            self.cfg.max_retries,
                        )
                        raise
        finally:
            for ref in pending:  # a unit failed for good (or the driver was interrupted)
                ray.cancel(ref)

    def close(self) -> None:
        if self._owns_connection and self._ray.is_initialized():
            self._ray.shutdown()
