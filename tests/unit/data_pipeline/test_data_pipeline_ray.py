"""executor=ray on a real two-node Ray cluster started here: a worker killed mid-step, retries, and
the bytes of the local executor."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from data_contract.errors import ConfigError
from data_pipeline import registry
from data_pipeline.config import load_config
from data_pipeline.document_step import Verdicts, write_split
from data_pipeline.io.shards import read_documents, read_marker, shard_file
from data_pipeline.runner import plan, run
from data_pipeline.stage import Stage, Step
from data_pipeline.synthetic import planted_corpus
from tests.conftest import scratch_dir
from tests.ranks import free_port

ROOT = Path(__file__).resolve().parents[3]
RAY = str(Path(sys.executable).with_name("ray"))
STAGES = [
    "normalize",
    "exact_dedup",
    "near_dedup",
    "kill_once",
    "quality_filter",
    "train_tokenizer",
    "tokenize_pack",
]


@dataclass
class KillOnceConfig:
    flag: str = ""
    """Absent: unit ``victim`` creates it (with its pid) and SIGKILLs its own process, once."""
    victim: int = 1
    always_fail: str = ""  # a file: every attempt of unit ``victim`` appends a line, then raises OSError
    meet: str = ""
    """A directory: units 0 and 2 each wait there until the other has started, so they run at the
    same time, which on nodes of 1 CPU means on both nodes (the scheduler may otherwise, legitimately,
    put every unit on one node, e.g. while the victim's node restarts its worker)."""

    def validate(self) -> KillOnceConfig:
        return self


def _kill_once(ctx, unit: int) -> dict:
    cfg: KillOnceConfig = ctx.config
    if unit == cfg.victim and cfg.always_fail:
        with open(cfg.always_fail, "a") as f:
            f.write(f"{os.getpid()}\n")
        raise OSError("the shared filesystem went away")
    flag = Path(cfg.flag)
    if unit == cfg.victim and not flag.exists():
        flag.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: other units of this step run on
    if cfg.meet and unit in (0, 2):
        Path(cfg.meet, f"started-{unit}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not Path(cfg.meet, f"started-{2 - unit}").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"unit {2 - unit} never ran beside unit {unit}")  # not retried
            time.sleep(0.05)
    docs = read_documents(ctx.docs_dir / shard_file(unit))
    stats = write_split(ctx, unit, docs, Verdicts([None] * docs.num_rows))
    on_ray = ray.is_initialized()
    return {
        **stats,
        "pid": os.getpid(),
        "node": ray.get_runtime_context().get_node_id() if on_ray else "local",
    }


class KillOnce(Stage):
    """Keeps every document; its unit ``victim`` kills its worker process the first time it runs."""

    name = "kill_once"
    Config = KillOnceConfig

    def steps(self) -> list[Step]:
        return [self.step(_kill_once, writes_documents=True)]


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to the `ray start --block` commands we started (each tears its node down), then
    SIGKILL to whatever of their own process groups is left."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in processes:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A head and a second node on this machine, 1 CPU each, in a temporary directory of their own."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}  # the workers import this checkout's data_pipeline
    common = ["--num-cpus=1", "--block", "--disable-usage-stats", "--object-store-memory=100000000"]
    port = free_port()
    address = f"127.0.0.1:{port}"
    processes: list[subprocess.Popen] = []
    log = open(Path(temp_dir) / "start.log", "w")  # noqa: SIM115 (closed below)
    try:
        start = [
            RAY,
            "start",
            "--head",
            f"--port={port}",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=false",
        ]
        processes.append(
            subprocess.Popen([*start, *common], env=env, start_new_session=True, stdout=log, stderr=log)
        )
        deadline = time.monotonic() + 120
        while subprocess.run(
            [RAY, "status", f"--address={address}"], capture_output=True, env=env
        ).returncode:
            assert time.monotonic() < deadline and processes[0].poll() is None, "the Ray head did not start"
            time.sleep(1)
        join = [RAY, "start", f"--address={address}"]
        processes.append(
            subprocess.Popen([*join, *common], env=env, start_new_session=True, stdout=log, stderr=log)
        )
        ray.init(address=address)
        try:
            while ray.cluster_resources().get("CPU", 0) < 2:
                assert time.monotonic() < deadline, "the second Ray node did not join"
                time.sleep(1)
        finally:
            ray.shutdown()
        yield address
    finally:
        _stop(processes[::-1])
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus(request: pytest.FixtureRequest) -> Path:
    """Two files, one cut into shards by rows: near and exact duplicates across the shards."""
    planted = planted_corpus(num_originals=240, words_per_doc=80, targets=[0.0, 0.9], seed=11)
    records = [{"id": i, "text": t} for i, t in zip(planted.ids, planted.texts)]
    records += [{"id": f"copy-{k}", "text": planted.texts[k * 3]} for k in range(40)]
    root = scratch_dir(request, "ray_in")
    half = len(records) // 2
    for name, part in (("a.jsonl", records[:half]), ("b.jsonl", records[half:])):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return root


def _values(corpus: Path, out: Path, flag: Path, meet: Path | None = None, **overrides) -> dict:
    return {
        "input": {"path": str(corpus), "rows_per_shard": 100},
        "output_dir": str(out),
        "stages": STAGES,
        "kill_once": {"flag": str(flag), "meet": str(meet or "")},
        "near_dedup": {"cluster_partitions": 3},
        "tokenizer": {"vocab_size": 300, "padded_vocab_size": None, "max_bytes": None},
        **overrides,
    }


def _outputs(out: Path) -> dict[str, bytes]:
    """Every file of the run but stats.json, the markers (seconds, pids, memory) and temporary
    files a killed unit left behind."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "stats.json" and "done" not in p.parts and ".tmp-" not in p.name
    }


@pytest.mark.slow
def test_ray_cluster_survives_a_killed_worker_and_writes_the_local_bytes(
    cluster: str, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.STAGES, "kill_once", KillOnce)
    flag = tmp_path / "killed"
    flag.write_text("not on the local run")
    meet = tmp_path / "meet"  # the same setting on both runs: a step's directory names its settings' hash
    meet.mkdir()
    for unit in (0, 2):  # the local run runs units one after the other: they must not wait
        (meet / f"started-{unit}").write_text("local")
    local = run(load_config(_values(corpus, tmp_path / "local", flag, meet)))
    assert local is not None and local["stages"]["near_dedup"]["removed"]["near_duplicate"] > 100

    flag.unlink()
    for started in meet.iterdir():
        started.unlink()
    on_ray = _values(corpus, tmp_path / "ray", flag, meet, executor={"kind": "ray", "address": cluster})
    stats = run(load_config(on_ray))
    assert stats is not None and not ray.is_initialized()  # the run closed its connection
    killed_pid = int(flag.read_text())
    step = next(p for p in plan(load_config(on_ray)) if p.step.name == "kill_once")
    markers = [read_marker(step.context.step_dir, u) for u in range(step.num_units)]
    assert step.num_units == 4  # 2 files of 200 lines in shards of 100
    assert markers[1]["pid"] != killed_pid  # the victim unit was run again, by another worker
    assert len({m["node"] for m in markers}) == 2  # both nodes ran units
    assert _outputs(tmp_path / "ray") == _outputs(tmp_path / "local")
    assert stats["output"] == local["output"]

    # a unit failing with an OSError each time: retried max_retries times, then the run fails
    attempts = tmp_path / "attempts"
    failing = _values(
        corpus, tmp_path / "fail", flag, executor={"kind": "ray", "address": cluster, "max_retries": 2}
    )
    failing["kill_once"]["always_fail"] = str(attempts)
    with pytest.raises(OSError, match="shared filesystem"):
        run(load_config(failing))
    assert len(attempts.read_text().splitlines()) == 3
    assert not (tmp_path / "fail" / "kept").exists() and not ray.is_initialized()


@pytest.mark.parametrize(
    ("executor", "num_proc", "message"),
    [
        ({"kind": "spark"}, 1, "executor.kind='spark'"),
        ({"kind": "ray"}, 4, "num_proc=4 sets local processes"),
        ({"kind": "ray", "max_retries": -1}, 1, "executor.max_retries=-1"),
        ({"kind": "ray", "address": ""}, 1, "executor.address is empty"),
    ],
)
def test_bad_executor_settings_fail_early_naming_the_field(
    executor: dict, num_proc: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"input": {"path": "x"}, "output_dir": "y", "executor": executor, "num_proc": num_proc})


def test_a_ray_head_that_does_not_answer_is_refused_before_any_write(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "x"}\n')
    values = {"input": {"path": str(tmp_path / "in")}, "output_dir": str(tmp_path / "out")}
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=f"executor.address={address}: no Ray head answers"):
        run(load_config({**values, "executor": {"kind": "ray", "address": address}}))
    assert not (tmp_path / "out").exists() and not ray.is_initialized()


def test_a_port_where_no_ray_head_speaks_is_refused_within_the_timeout(tmp_path: Path) -> None:
    """Before: a port that accepted TCP but was no Ray head made ``ray.init`` retry every 30 s,
    deaf to SIGTERM. Now the gRPC handshake fails within executor.connect_timeout_s, one line."""
    import socket
    import time

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "x"}\n')
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never speaks
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    values = {"input": {"path": str(tmp_path / "in")}, "output_dir": str(tmp_path / "out"),
              "executor": {"kind": "ray", "address": address, "connect_timeout_s": 2}}
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=rf"executor.address={address}: something listens there but no Ray "
                                              r"head answered a gRPC \(HTTP/2\) call of Ray's GCS within executor.connect_timeout_s=2 s"):
            run(load_config(values))
    finally:
        listener.close()
    assert time.monotonic() - start < 30  # the bound, not a measurement: ray.init alone retried for minutes
    assert not (tmp_path / "out").exists() and not ray.is_initialized()


@pytest.mark.parametrize("reply", ["silence", "unimplemented", "goaway"])
def test_an_http2_server_that_is_no_ray_head_is_refused_within_the_timeout(tmp_path: Path, reply: str) -> None:
    """Before: anything answering HTTP/2's preface with a SETTINGS frame (any gRPC or HTTP/2 server)
    passed the check and ``ray.init`` then hung. Now the check makes a call only Ray's GCS answers
    with a message: a server that then says nothing, answers UNIMPLEMENTED (a headers-only reply, as
    gRPC does for an unknown method) or goes away is refused, one line."""
    import socket
    import threading
    import time

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "x"}\n')
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)  # the preface and our SETTINGS
            connection.sendall(frame(4, 0, 0))  # SETTINGS: "an HTTP/2 server"
            if reply == "unimplemented":  # HEADERS, END_STREAM | END_HEADERS: ":status 200" (indexed 8)
                connection.sendall(frame(1, 0x5, 1, b"\x88"))
            elif reply == "goaway":
                connection.sendall(frame(7, 0, 0, bytes(8)))
            time.sleep(5)

    threading.Thread(target=serve, daemon=True).start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    values = {"input": {"path": str(tmp_path / "in")}, "output_dir": str(tmp_path / "out"),
              "executor": {"kind": "ray", "address": address, "connect_timeout_s": 2}}
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=rf"executor.address={address}: something listens there but no Ray head"):
            run(load_config(values))
    finally:
        listener.close()
    assert time.monotonic() - start < 10 and not (tmp_path / "out").exists() and not ray.is_initialized()
    if reply != "silence":  # answered at once: not a wait for the deadline
        assert time.monotonic() - start < 2


def test_sigterm_ends_a_ray_run_waiting_for_its_head_within_seconds(tmp_path: Path) -> None:
    """Before: waiting on an address that was no Ray head, the pipeline ignored SIGTERM (only
    SIGKILL ended it). Now it waits in our own handshake, which a SIGTERM ends at once."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "x"}\n')
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    accepted: list = []
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "data_pipeline", f"input.path={tmp_path / 'in'}", f"output_dir={tmp_path / 'out'}",
             "executor=ray", f"executor.address={address}", "executor.connect_timeout_s=120", "stages=[normalize]"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        # accepted connections are kept open: the client waits for the head's answer
        while time.monotonic() < deadline and not accepted:  # until it is connected, waiting for the handshake
            time.sleep(0.5)
            if proc.poll() is not None:
                break
            accepted += _peer_connections(listener)
        time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - sent < 10  # a bound, not a measurement: before, it never ended
        assert proc.returncode != 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        for connection in accepted:
            connection.close()
        listener.close()


def _peer_connections(listener) -> list:
    """Connections waiting on the listener (accepted here, so the client's handshake starts)."""
    listener.setblocking(False)
    try:
        connection, _ = listener.accept()
        return [connection]
    except BlockingIOError:
        return []
