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
import time
from typing import Any

from data_contract.errors import ConfigError
from data_pipeline.context import Context
from data_pipeline.executors import ExecutorConfig, UnitFn
from data_pipeline.stage import Step

log = logging.getLogger(__name__)
_POLL_SECONDS = 1.0
_CONNECT_SECONDS = 5.0


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _GOAWAY = 0, 1, 3, 4, 7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
"""A call only a Ray head's GCS answers with a message (its cluster id); another gRPC server answers
UNIMPLEMENTED in a headers-only reply, another HTTP/2 server with no gRPC message at all."""


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:
    """One HPACK header "literal without indexing, new name", no Huffman (RFC 7541 6.2.2)."""
    def string(text: str) -> bytes:
        data = text.encode()
        assert len(data) < 127  # a one-byte length: every header we send is short
        return bytes([len(data)]) + data
    return b"\x00" + string(name) + string(value)


def _gcs_request(authority: str) -> bytes:
    """The unary gRPC call :data:`_GCS_METHOD` with an empty request, on stream 1."""
    headers = b"".join(_literal(n, v) for n, v in ((":method", "POST"), (":scheme", "http"), (":path", _GCS_METHOD),
                                                    (":authority", authority), ("content-type", "application/grpc"),
                                                    ("te", "trailers")))
    return (_frame(_HEADERS, _END_HEADERS, 1, headers)
            + _frame(_DATA, _END_STREAM, 1, b"\x00\x00\x00\x00\x00"))  # uncompressed, 0 bytes


def _answers_as_a_ray_head(connection: socket.socket, authority: str, deadline: float) -> bool:
    """After the HTTP/2 preface: whether the peer answers :data:`_GCS_METHOD` with a gRPC message
    before ``deadline`` (``time.monotonic()``), however it trickles its frames."""
    def read(n: int) -> bytes:
        data = b""
        while len(data) < n:
            if time.monotonic() >= deadline:
                raise TimeoutError("deadline")
            connection.settimeout(deadline - time.monotonic())
            chunk = connection.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    connection.sendall(_HTTP2_PREFACE)
    request_sent = False
    while True:
        header = read(9)
        length, kind, flags, stream = int.from_bytes(header[:3], "big"), header[3], header[4], \
            int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        read(length)  # the frame's payload: only its header matters here
        if kind == _SETTINGS and not flags & _ACK:
            connection.sendall(_frame(_SETTINGS, _ACK, 0) + (b"" if request_sent else _gcs_request(authority)))
            request_sent = True
        elif stream == 1 and kind == _DATA and length > 5:
            return True  # a gRPC message: the GCS's reply
        elif kind == _GOAWAY or (stream == 1 and (kind == _RST_STREAM or flags & _END_STREAM)):
            return False  # refused, or a headers-only reply (grpc-status UNIMPLEMENTED)


def _check_reachable(address: str, timeout: float) -> None:
    """A named head must answer before ``ray.init`` is called: ``ray.init`` retries an address that
    is not a Ray head for minutes, deaf to SIGTERM. Ray's head (its GCS) is a gRPC server: it answers
    a call of its own (:data:`_GCS_METHOD`) with a message; a port where nothing listens, another
    service, another gRPC or HTTP/2 server does not within ``timeout`` seconds."""
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
        answered = _answers_as_a_ray_head(connection, f"{host}:{port}", time.monotonic() + timeout)
    except (OSError, ConnectionError):  # timed out, reset or closed
        answered = False
    finally:
        connection.close()
    if not answered:
        raise ConfigError(
            f"executor.address={address}: something listens there but no Ray head answered a gRPC (HTTP/2) "
            f"call of Ray's GCS within executor.connect_timeout_s={timeout:g} s; give <host>:<port> of a running head "
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
